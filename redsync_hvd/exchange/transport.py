"""Starting the exchange's collectives, and turning what arrives into averaged gradients.

Dense layers and allreduce methods: one named (in place) allreduce per message tensor; Horovod
fuses concurrent small ones. Allgather methods: each bucket's messages are packed into one
fixed-size header and one byte payload (comm/packing.py) and allgathered as soon as the
bucket's last layer is in, so early buckets overlap the rest of backward. A compressor whose
bucket message sizes are known in advance (``fixed_bucket_counts``: exactly k per layer) sends
no header: every rank cuts the payload by the counts it already knows, one collective fewer
per bucket and no read of a header on the host. The compressor decodes a gathered bucket
(``decompress_bucket``: layer by layer by default, or, where it ``decodes_flat``, in one pass
into one flat buffer whose views are the layers' averages).

A bucket whose ``aggregation`` is sparse_reduce_scatter goes through exchange/reduce_scatter.py
instead: its alltoall starts when its last message is in; the owners' sums and one allgather of
what they keep, for all such buckets at once, run in ``collect``, and what no owner kept is
added back into this rank's residual buffers (``StepState.kept``) before the memory commits.
"""
from __future__ import annotations

import torch

from ..comm.packing import pack, unpack_fixed, unpack_gathered
from ..compressors.dense import NoneCompressor
from . import reduce_scatter
from .reduce_scatter import SparseReduceScatter
from .step import Bucket, StepState

REDUCE_SCATTER = "sparse_reduce_scatter"


class Transport:
    def __init__(self, comm, stats, layers: dict, buckets: list, reuse_buffers: bool = True):
        self.comm = comm
        self.layers = layers
        self.stats = stats
        self.buckets = buckets
        self.bucket_of = {l.name: b for b in buckets for l in b.layers}
        # Layer-sized buffers that live across steps. A fresh CPU tensor of tens of MB is
        # mmapped and page-faulted in on every step (several times the cost of filling a warm
        # one), so outputs and in-place allreduce buffers are allocated once; finish()'s
        # tensors are then valid until the next step. Callers that keep them longer (a TF
        # tensor sharing the memory through DLPack) pass reuse_buffers=False.
        self.reuse_buffers = reuse_buffers
        self._buffers: dict = {}
        self._reduce_scatters: dict = {}   # bucket index -> SparseReduceScatter

    # -- sending ------------------------------------------------------------------------
    def own(self, comp, name: str, x: torch.Tensor, msg, in_place_ok: bool):
        """Before the memory update overwrites x: an in-place allreduce gets buffers of ours (no
        output allocation per step), unless it may reduce the caller's gradient itself."""
        if comp.collective == "allreduce" and hasattr(self.comm, "allreduce_async_"):
            msg.tensors = [t if in_place_ok and t is x else self._owned(f"{name}.{i}", t)
                           for i, t in enumerate(msg.tensors)]
        elif not in_place_ok and any(_aliases(t, x) for t in msg.tensors):
            raise RuntimeError(f"{type(comp).__name__}.compress returned a view of its input for {name!r}: the "
                               "memory update would overwrite the message; return a copy")
        return msg

    def returns(self, layer) -> bool:
        """Whether the entries of ``layer`` that no owner keeps come back to this rank's residual
        in ``collect`` (its bucket travels by the sparse reduce-scatter)."""
        bucket = self.bucket_of.get(layer.name)
        return bucket is not None and bucket.aggregation == REDUCE_SCATTER

    def send(self, state: StepState, comp, layer, msg) -> None:
        self._account(layer, msg, counted=not self.returns(layer))
        if comp.collective == "allreduce":
            start = getattr(self.comm, "allreduce_async_", self.comm.allreduce_async)
            state.reduce[layer.name] = ([start(t, name=f"rsync.{layer.name}.{i}") for i, t in enumerate(msg.tensors)],
                                        msg)
            return
        bucket = self.bucket_of[layer.name]
        messages = state.gather.setdefault(bucket.index, {})
        messages[layer.name] = msg
        if len(messages) == len(bucket.layers) and bucket.aggregation == REDUCE_SCATTER:
            msgs = [messages[l.name] for l in bucket.layers]
            state.handles[bucket.index] = self._reduce_scatter(comp, bucket, msgs[0]).start(
                [m.tensors[0] for m in msgs], [m.tensors[-1] for m in msgs], [l.k for l in bucket.layers])
        elif len(messages) == len(bucket.layers):
            tensors = comp.bucket_tensors(bucket.layers, [messages[l.name] for l in bucket.layers])
            header, payload = pack(tensors, device=bucket.layers[0].device)
            counts = comp.fixed_bucket_counts(bucket.layers)
            if counts is None:
                self.stats.add_bytes({"headers": header.numel() * 4})
                header = self.comm.allgather_async(header, name=f"rsync.bucket{bucket.index}.hdr")
            elif [t.numel() for t in tensors] != list(counts):
                raise RuntimeError(f"{type(comp).__name__} declared fixed message sizes {list(counts)} for bucket "
                                   f"{bucket.index} but sent {[t.numel() for t in tensors]}")
            else:
                header = None   # every rank knows the sizes: no header allgather
            state.handles[bucket.index] = (header, self.comm.allgather_async(payload,
                                                                             name=f"rsync.bucket{bucket.index}.data"))

    def _reduce_scatter(self, comp, bucket: Bucket, msg) -> SparseReduceScatter:
        """The bucket's reduce-scatter, made with its first step's messages: their value dtype, and
        whether they carry one mean per layer (sign-mean) or a value per position."""
        rsc = self._reduce_scatters.get(bucket.index)
        if rsc is None:
            message = getattr(comp.config, "message", None)
            rsc = self._reduce_scatters[bucket.index] = SparseReduceScatter(
                self.comm, [l.numel for l in bucket.layers], f"rsync.bucket{bucket.index}", msg.tensors[-1].dtype,
                sign_mean=getattr(message, "quantize", None) == "sign_mean")
        return rsc

    def _account(self, layer, msg, counted: bool = True) -> None:
        """Bytes and counts of one message; a reduce-scatter bucket's bytes are counted in
        ``collect`` instead (``counted`` False), from what its two collectives moved."""
        group = "sparse" if layer.compressed else "dense"
        wire = msg.nbytes()
        if counted:
            self.stats.add_bytes(wire, group)
        self.stats.add("dense_bytes", 4 * layer.numel)
        if msg.selected is not None:
            for key, value in (("selected", msg.selected), ("k", msg.k)):
                self.stats.add(key, value)
                self.stats.add(f"{key}[{layer.name}]", value)
        self.stats.layer(layer.name, group, msg.selected, msg.k, sum(wire.values()), 4 * layer.numel)

    # -- receiving ------------------------------------------------------------------------
    def collect(self, state: StepState, compressor_for, into: dict, apply: dict) -> tuple[dict, list]:
        """Wait for every collective and decode: ({name: averaged flat gradient}, sparse updates).

        ``into``: {name: flat fp32 tensor} to decode sparse layers into (saves a copy). ``apply``:
        {name: (flat parameter, lr)}: such allgather layers are not decoded here but returned as
        (layer, tensors, alpha) updates, applied to the weights once every check has passed."""
        with self.stats.timer("communicate", "allreduce"):
            reduced = {n: ([self.comm.wait(h) for h in hs], msg) for n, (hs, msg) in state.reduce.items()}
        scattered = [b for b in self.buckets if b.aggregation == REDUCE_SCATTER]
        if scattered:
            with self.stats.timer("communicate", "reduce_scatter"):
                pendings = [state.handles[b.index] for b in scattered]
                for b, pending in zip(scattered, pendings):   # the owners' sums, in bucket order
                    self._reduce_scatters[b.index].reduce(pending)
                # every bucket's kept entries in one allgather: one round, however many buckets
                handle = reduce_scatter.allgather(self.comm, pendings, name="rsync.reselected")
                reduce_scatter.wait_allgather(self.comm, handle, pendings)
        with self.stats.timer("communicate", "allgather"):
            gathered = [(b, None if header is None else self.comm.wait(header), self.comm.wait(data))
                        for b in self.buckets if b.aggregation != REDUCE_SCATTER
                        for header, data in (state.handles[b.index],)]
        out: dict = {}
        with self.stats.timer("decompress", "allreduce"):
            for name, (tensors, msg) in reduced.items():
                layer = self.layers[name]
                out[name] = self._decode_reduced(compressor_for(layer), layer, tensors, msg, into)
        with self.stats.timer("decompress", "reduce_scatter"):
            for b in scattered:
                self._finish_reduce_scatter(state, b, out)
        updates: list = []
        with self.stats.timer("decompress", "allgather"):
            for bucket, header, payload in gathered:
                self._decode_bucket(compressor_for(bucket.layers[0]), bucket, header, payload, into, apply, out,
                                    updates)
        return out, updates

    def _finish_reduce_scatter(self, state: StepState, bucket: Bucket, out: dict) -> None:
        """A reduce-scatter bucket's averages (views of the bucket's flat buffer), its bytes, and what
        no owner kept back into this rank's residuals (pending until the memory commits)."""
        got = self._reduce_scatters[bucket.index].finish(state.handles[bucket.index], out=self._flat(bucket))
        self.stats.add_bytes({"alltoall": got.bytes["alltoall_sent"], "reselected": got.bytes["allgather_sent"]},
                             "sparse")
        for layer, average, (positions, values) in zip(bucket.layers, got.averages, got.carry):
            out[layer.name] = average
            residual = state.kept.get(layer.name)
            if residual is not None and positions.numel():
                residual.index_add_(0, positions.to(residual.device), values.to(residual))

    def _decode_reduced(self, comp, layer, tensors, msg, into) -> torch.Tensor:
        if type(comp) is NoneCompressor and tensors[0].dtype == torch.float32:
            return tensors[0].reshape(-1)   # already the average: no copy
        buf = self._zeroed(layer, tensors[0].device, into)
        comp.decompress_add(buf, tensors, layer, ctx=msg.ctx)
        return buf

    def _decode_bucket(self, comp, bucket: Bucket, header, payload, into, apply, out, updates) -> None:
        """1. cut every rank's message out of the payload (by its header, or by the sizes known in
        advance); 2. layers to apply to the weights become updates; 3. the compressor decodes the
        others into zeroed buffers (the caller's ``into``, or views of one flat buffer)."""
        size, layers = self.comm.size, bucket.layers
        dtypes = comp.bucket_dtypes(layers)
        if header is None:
            per_rank = unpack_fixed(payload, comp.fixed_bucket_counts(layers), dtypes, size)       # 1.
        else:
            per_rank = unpack_gathered(header, payload, dtypes, size)
        # a power-of-two size scales each term exactly (subnormals aside), so adding v/size
        # equals dividing the sum bit for bit, and saves a pass over every output
        exact_scale = size & (size - 1) == 0
        alpha = 1.0 / size if exact_scale else 1.0
        applied = any(l.name in apply for l in layers)
        if applied:                                                                                 # 2.
            for tensors in per_rank:
                for layer, part in zip(layers, comp.split_bucket(layers, tensors)):
                    if layer.name in apply:   # applied to the weights after the checks
                        updates.append((layer, part, -apply[layer.name][1] / size))
        flat = self._flat(bucket) if comp.decodes_flat(layers) and not applied else None
        if flat is not None:
            bufs = dict(zip((l.name for l in layers), flat.split([l.numel for l in layers])))
        else:
            bufs = {l.name: self._zeroed(l, l.device, into) for l in layers if l.name not in apply}
        comp.decompress_bucket(bufs, per_rank, layers, alpha=alpha, flat=flat)                      # 3.
        if not exact_scale:
            for t in ([flat] if flat is not None else bufs.values()):
                t.div_(size)
        out.update(bufs)

    # -- buffers ----------------------------------------------------------------------------
    def _owned(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = torch.empty_like(t)
            if self.reuse_buffers:
                self._buffers[key] = buf
        return buf.copy_(t)

    def _flat(self, bucket: Bucket) -> torch.Tensor:
        """One zeroed fp32 buffer for a bucket decoded flat (its layers' averages are views)."""
        n, device = sum(l.numel for l in bucket.layers), bucket.layers[0].device
        key = ("bucket", bucket.index)   # not a layer name
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != n or buf.device != torch.device(device):
            buf = torch.empty(n, dtype=torch.float32, device=device)
            if self.reuse_buffers:
                self._buffers[key] = buf
        return buf.zero_()

    def _zeroed(self, layer, device, into: dict) -> torch.Tensor:
        target = into.get(layer.name)
        if target is not None and target.device == torch.device(device):
            return target.zero_()
        buf = self._buffers.get(layer.name)
        if buf is None or buf.device != torch.device(device):
            buf = torch.empty(layer.numel, dtype=torch.float32, device=device)
            if self.reuse_buffers:
                self._buffers[layer.name] = buf
        return buf.zero_()


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
