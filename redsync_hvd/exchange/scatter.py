"""Buckets that meet by the sparse reduce-scatter (``aggregation: sparse_reduce_scatter``), whose
bytes per worker stay flat in N (reduce_scatter.py has the algorithm and its measurements).

Each :class:`ScatterBucket` runs steps 1-3 as any bucket of per-layer messages does, and once its
last message is in, starts its alltoall of (position, value) entries to their owners, with its
count of non-finite inputs summed by a one-element allreduce (the alltoall's sizes differ per
owner: no room for it there). :class:`ScatterGroup` finishes every such bucket at once:

    1. the owners' sums and their re-selection, bucket by bucket in order;
    2. one allgather of what every owner kept, for all the buckets (one round, however many);
    3. per bucket, the averages, its bytes, and what no owner kept back into this rank's
       residuals (pending until the memory commits, so a failed step rolls it back too).
"""
from __future__ import annotations

import torch

from . import reduce_scatter
from .buckets import Bucket, account
from .reduce_scatter import SparseReduceScatter
from .step import Arrived, StepState


class ScatterBucket(Bucket):
    """A gather bucket's layers, met by the sparse reduce-scatter; the entries no owner kept come
    back into the memory's residuals of this step (``give_back``)."""
    kind = "scatter"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rsc: SparseReduceScatter | None = None

    def clear(self) -> None:
        super().clear()
        self._pending, self._count_handle = None, None

    def _account(self, layer, msg) -> None:
        account(self.stats, layer, msg, counted=False)   # its bytes: what the collectives moved, in finish

    def _start(self, st: StepState, messages: list) -> None:
        kinds = messages[0].kinds
        at = kinds.index("scalars" if "scalars" in kinds else "values")   # the values follow the positions
        golomb = "headers" in kinds
        if self.rsc is None:   # made with the first step's messages: their value dtype, sign-mean, coding
            self.rsc = SparseReduceScatter(self.comm, [l.numel for l in self.layers], self.name,
                                           messages[0].tensors[at].dtype, sign_mean=kinds[at] == "scalars",
                                           index_coding="golomb" if golomb else "raw")
        scales = [m.tensors[at + 1] for m in messages] if "scales" in kinds else None
        self._pending = self.rsc.start([_positions(m, golomb) for m in messages], [m.tensors[at] for m in messages],
                                       [l.k for l in self.layers], scales)
        self.stats.add_bytes({"scalars": 4})
        self._count_handle = self.comm.allreduce_async(self._count(messages), name=f"{self.name}.bad", average=False)

    def decode(self, into: dict) -> Arrived:
        """Step 3 for this bucket, after the group's allgather."""
        flat = self.buffers.get(("scatter", self.index), sum(self.rsc.numels), torch.float32, self.layers[0].device)
        result = self.rsc.finish(self._pending, out=flat.zero_())
        self.stats.add_bytes({"alltoall": result.bytes["alltoall_sent"],
                              "reselected": result.bytes["allgather_sent"]}, "sparse")
        got = Arrived(flags=self.comm.wait(self._count_handle))
        for layer, average, (positions, values) in zip(self.layers, result.averages, result.carry):
            target = into.get(layer.name)
            got.averages[layer.name] = target.copy_(average) if target is not None else average
            self.memory.give_back(layer.name, positions, values)
        return got


def _positions(message, golomb: bool) -> torch.Tensor:
    """A message's positions, raw: Golomb-coded ones are re-coded per owner, in order (as their
    values travel), so the bucket takes the positions the compressor kept beside the code, ascending
    as the codec sent them (``MessageCodec.in_order``)."""
    return message.positions.reshape(-1) if golomb else message.tensors[0]


class ScatterGroup:
    """Finishes every :class:`ScatterBucket` of the exchange together; see the module docstring."""

    def __init__(self, buckets: list, comm, stats):
        self.buckets, self.comm, self.stats = buckets, comm, stats

    def finish(self, into: dict, apply: dict) -> Arrived:
        """Every scatter bucket's averages and counts of non-finite inputs, as one bucket's."""
        pendings = [b._pending for b in self.buckets]
        with self.stats.timer("communicate", "reduce_scatter"):
            for bucket, pending in zip(self.buckets, pendings):                                      # 1.
                bucket.rsc.reduce(pending)
            handle = reduce_scatter.allgather(self.comm, pendings, name="rsync.reselected")          # 2.
            reduce_scatter.wait_allgather(self.comm, handle, pendings)
        with self.stats.timer("decompress", "reduce_scatter"):
            got = [bucket.decode(into) for bucket in self.buckets]                                    # 3.
        return Arrived(averages={n: t for a in got for n, t in a.averages.items()},
                       flags=torch.cat([a.flags.reshape(-1) for a in got]))



