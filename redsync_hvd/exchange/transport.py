"""Starting the exchange's collectives, and turning what arrives into averaged gradients.

Every layer travels in a fixed bucket (step.py), one collective per bucket, started as soon as
the bucket's last layer is in, so early buckets overlap the rest of backward:

* ``reduce`` buckets: the messages (dense gradients, fp16 values, random-k values) back to back
  in one flat buffer per dtype, plus two kinds of slots: the bucket's count of non-finite inputs
  and, in the first reduce bucket, the caller's carry values; one allreduce sums it all.
* ``gather`` buckets: every layer's message packed into one byte payload (comm/packing.py) with
  the bucket's count of non-finite inputs last; one allgather, plus a fixed-size header
  allgather where the message sizes vary per rank. A compressor whose sizes are known in advance
  (``fixed_bucket_counts``: exactly k per layer) sends no header; a bucket with a plan
  (``plan.py``) hands over its payload ready made. On torch.distributed, which needs every
  rank's size before an allgather, a compressor that bounds its sizes (``bucket_capacity``)
  sends one row of that capacity with the counts inside, instead of a header round first.
* ``gather`` buckets whose ``aggregation`` is sparse_reduce_scatter go through reduce_scatter.py
  instead: the alltoall starts when the bucket's last message is in, with a one-element
  allreduce of its non-finite count; the owners' sums and one allgather of what they keep, for
  all such buckets at once, run in ``collect``, and what no owner kept is added back into this
  rank's residuals (``StepState.kept``) before the memory commits.
* layers of a ``blocking`` compressor (it runs collectives inside ``compress``) are compressed in
  ``finish()``, a bucket at once in a fixed order, and travel in reduce buckets too.

So the step's agreement that every input was finite rides in the collectives the step makes
anyway: ``collect`` returns the counts (device tensors) and the caller reads them once.
"""
from __future__ import annotations

import torch

from ..comm.packing import pack, payload_bytes, unpack_fixed, unpack_gathered
from ..compressors.dense import NoneCompressor
from ..memory.residual import layer_views
from . import reduce_scatter
from .reduce_scatter import SparseReduceScatter
from .step import Bucket, StepState

CARRY_SLOTS = 8   # the carrier bucket's room for the caller's carry values (the runner sends 3)
REDUCE_SCATTER = "sparse_reduce_scatter"
ROWS = "rows"     # a gather bucket sent as capacity rows: sizes and data in one allgather


def nonfinite_count(evidence: list, extra: int = 0, device=None) -> torch.Tensor:
    """(1,) float32 on the device: how many of ``evidence`` (device scalars or vectors: sums,
    norms, flags with inf where set) are not finite, plus ``extra`` known on the host."""
    if not evidence:
        return torch.full((1,), float(extra), device=device)
    values = torch.cat([e.reshape(-1).float() for e in evidence])
    return ((~torch.isfinite(values)).sum(dtype=torch.float32) + extra).reshape(1)


class Transport:
    def __init__(self, comm, stats, layers: dict, buckets: list, plans: dict, reuse_buffers: bool = True):
        self.comm, self.stats, self.layers = comm, stats, layers
        self.buckets, self.plans = buckets, plans
        self.bucket_of = {l.name: b for b in buckets for l in b.layers}
        self.carrier = next((b.index for b in buckets if b.kind == "reduce"), None)
        # torch.distributed must know every rank's size before an allgather starts
        self.needs_sizes = getattr(comm, "needs_sizes", False)
        # Buffers that live across steps. A fresh CPU tensor of tens of MB is mmapped and
        # page-faulted in on every step (several times the cost of filling a warm one), so
        # outputs and fused buffers are allocated once; finish()'s tensors are then valid until
        # the next step. Callers that keep them longer (a TF tensor sharing the memory through
        # DLPack) pass reuse_buffers=False.
        self.reuse_buffers = reuse_buffers
        self._buffers: dict = {}
        self._reduce_scatters: dict = {}   # bucket index -> SparseReduceScatter

    # -- sending ------------------------------------------------------------------------
    def returns(self, layer) -> bool:
        """Whether the entries of ``layer`` that no owner keeps come back to this rank's residual
        in ``collect`` (its bucket meets by the sparse reduce-scatter)."""
        bucket = self.bucket_of.get(layer.name)
        return bucket is not None and bucket.aggregation == REDUCE_SCATTER

    def send(self, state: StepState, comp, layer, msg) -> None:
        """A layer's message: into its bucket, whose collective starts once the bucket is complete."""
        self.account(layer, msg, counted=not self.returns(layer))
        bucket = self.bucket_of[layer.name]
        messages = state.messages.setdefault(bucket.index, {})
        messages[layer.name] = msg
        if len(messages) == len(bucket.layers):
            msgs = [messages[l.name] for l in bucket.layers]
            if bucket.kind == "reduce":
                self._start_reduce(state, bucket, msgs)
            elif bucket.aggregation == REDUCE_SCATTER:
                self._start_reduce_scatter(state, comp, bucket, msgs)
            else:
                self._start_gather(state, comp, bucket, msgs)

    def send_payload(self, state: StepState, bucket: Bucket, payload: torch.Tensor) -> None:
        """A planned bucket's ready-made payload (its sizes are known: no header)."""
        plan = self.plans[bucket.index]
        self.stats.add_many(plan.accounting)
        self.stats.layers.update(plan.layer_stats)
        state.handles[bucket.index] = (None, self.comm.allgather_async(payload, name=bucket.name,
                                                                       sizes=[payload.numel()] * self.comm.size))

    def _start_gather(self, state: StepState, comp, bucket: Bucket, msgs: list) -> None:
        """1. the bucket's wire tensors and its non-finite count; 2. a header allgather where the
        sizes vary per rank (a transport that needs every rank's size before the data, as
        torch.distributed does, reads it now); 3. the payload's allgather."""
        host_bad = sum(1 for m in msgs if m.nonfinite is True)
        flags = [torch.where(m.nonfinite, torch.inf, 0.0) for m in msgs if isinstance(m.nonfinite, torch.Tensor)]
        flag = nonfinite_count(flags + state.evidence.pop(bucket.index, []), host_bad, bucket.layers[0].device)
        tensors = comp.bucket_tensors(bucket.layers, msgs) + [flag.to(torch.int32)]                  # 1.
        header, payload = pack(tensors, device=bucket.layers[0].device)
        counts, sizes = comp.fixed_bucket_counts(bucket.layers), None
        capacity = comp.bucket_capacity(bucket.layers) if counts is None and self.needs_sizes else None
        if capacity is not None:   # torch.distributed: one row of the bucket's capacity, sizes inside
            self.stats.add_bytes({"headers": header.numel() * 4, "scalars": 4})
            row = self._capacity_row(comp, bucket, tensors, header, payload, capacity)
            state.handles[bucket.index] = (ROWS, self.comm.allgather_async(row, name=bucket.name,
                                                                           sizes=[row.numel()] * self.comm.size))
            return
        if counts is None:                                                                           # 2.
            self.stats.add_bytes({"headers": header.numel() * 4})
            header = self.comm.allgather_async(header, name=f"{bucket.name}.hdr",
                                               sizes=[header.numel()] * self.comm.size)
            if self.needs_sizes:
                header = self.comm.wait(header)
                dtypes = comp.bucket_dtypes(bucket.layers) + [torch.int32]
                sizes = [payload_bytes(c, dtypes) for c in header.view(self.comm.size, -1).tolist()]
        elif [t.numel() for t in tensors[:-1]] != list(counts):
            raise RuntimeError(f"{type(comp).__name__} declared fixed message sizes {list(counts)} for bucket "
                               f"{bucket.index} but sent {[t.numel() for t in tensors[:-1]]}")
        else:
            header = None   # every rank knows the sizes: no header allgather
            sizes = [payload.numel()] * self.comm.size
        self.stats.add_bytes({"scalars": 4})
        state.handles[bucket.index] = (header, self.comm.allgather_async(payload, name=bucket.name, sizes=sizes))   # 3.

    def _capacity_row(self, comp, bucket: Bucket, tensors: list, header, payload, capacity: list) -> torch.Tensor:
        """[the header's int32 counts | the payload | zeros up to the capacity's payload], uint8: the
        same size on every rank, so one allgather carries sizes and data (``_open_rows`` cuts it)."""
        if any(t.numel() > c for t, c in zip(tensors, capacity)):
            raise RuntimeError(f"{type(comp).__name__} declared at most {capacity} elements per wire tensor for "
                               f"bucket {bucket.index} but sent {[t.numel() for t in tensors[:-1]]}")
        most = payload_bytes(list(capacity) + [1], comp.bucket_dtypes(bucket.layers) + [torch.int32])
        row = torch.zeros(4 * header.numel() + most, dtype=torch.uint8, device=payload.device)
        row[:4 * header.numel()] = header.to(payload.device).view(torch.uint8)
        row[4 * header.numel():4 * header.numel() + payload.numel()] = payload
        return row

    def _open_rows(self, comp, bucket: Bucket, rows: torch.Tensor) -> tuple:
        """Every rank's capacity row -> (the gathered headers, the payloads back to back): what a
        header round and the data's allgather would have given (one host read of the headers)."""
        dtypes = comp.bucket_dtypes(bucket.layers) + [torch.int32]
        rows = rows.view(self.comm.size, -1)
        width = 4 * len(dtypes)
        header = rows[:, :width].contiguous().view(torch.int32).reshape(-1)
        counts = header.view(self.comm.size, -1).tolist()
        payload = torch.cat([rows[r, width:width + payload_bytes(c, dtypes)] for r, c in enumerate(counts)])
        return header, payload

    def _start_reduce_scatter(self, state: StepState, comp, bucket: Bucket, msgs: list) -> None:
        """The bucket's alltoall to the positions' owners, and its non-finite count summed by a
        one-element allreduce (the alltoall's sizes differ per owner: no room for it there)."""
        rsc = self._reduce_scatters.get(bucket.index)
        if rsc is None:   # made with the first step's messages: their value dtype, and sign-mean or not
            rsc = self._reduce_scatters[bucket.index] = SparseReduceScatter(
                self.comm, [l.numel for l in bucket.layers], bucket.name, msgs[0].tensors[-1].dtype,
                sign_mean=msgs[0].kinds[-1] == "scalars")
        pending = rsc.start([m.tensors[0] for m in msgs], [m.tensors[-1] for m in msgs], [l.k for l in bucket.layers])
        host_bad = sum(1 for m in msgs if m.nonfinite is True)
        flags = [torch.where(m.nonfinite, torch.inf, 0.0) for m in msgs if isinstance(m.nonfinite, torch.Tensor)]
        count = nonfinite_count(flags + state.evidence.pop(bucket.index, []), host_bad, bucket.layers[0].device)
        self.stats.add_bytes({"scalars": 4})
        state.handles[bucket.index] = (pending, self.comm.allreduce_async(count, name=f"{bucket.name}.bad",
                                                                          average=False))

    def _start_reduce(self, state: StepState, bucket: Bucket, msgs: list) -> None:
        """1. the messages into the bucket's flat buffers (one per dtype; tensors already there, the
        gradients that landed in place, are not copied); 2. the first buffer's slots: this
        bucket's non-finite count (its layers' evidence and the buffer's own norm), and the
        carry values; 3. one in-place sum allreduce per buffer."""
        tensors = [t if t.dim() == 1 else t.reshape(-1) for m in msgs for t in m.tensors]
        slots = self._slots(bucket)
        flats = self._fused(bucket, tensors, slots)                                                  # 1.
        first = flats[0][0]
        n = first.numel() - slots
        evidence = state.evidence.pop(bucket.index, []) + [torch.linalg.vector_norm(first[:n], float("inf"))]
        first[n:n + 1] = nonfinite_count(evidence)                                                   # 2.
        if slots > 1:
            carry = state.carry or []
            first[n + 1:].copy_(torch.tensor(carry + [0.0] * (slots - 1 - len(carry)), dtype=first.dtype))
        self.stats.add_bytes({"scalars": 4})   # the count; carried values are the caller's traffic
        started = [self.comm.allreduce_async_(flat, name=f"{bucket.name}.{i}", average=False)
                   for i, (flat, _) in enumerate(flats)]                                             # 3.
        state.handles[bucket.index] = (flats, started, msgs)

    def _slots(self, bucket: Bucket) -> int:
        """Elements after a reduce bucket's values: its non-finite count, and in the carrier bucket
        room for the carry values (always there, so its buffer never changes size)."""
        return 1 + (CARRY_SLOTS if bucket.index == self.carrier else 0)

    def dense_views(self, bucket: Bucket, device) -> dict:
        """{name: the layer's view of the bucket's fused fp32 buffer} for a reduce bucket of dense
        layers (their message is the gradient itself): where their gradients should land."""
        sizes = [l.numel for l in bucket.layers]
        flat = self._buffer(("reduce", bucket.index, 0), sum(sizes) + self._slots(bucket), torch.float32, device)
        return dict(zip((l.name for l in bucket.layers), flat[:sum(sizes)].split(sizes)))

    def _fused(self, bucket: Bucket, tensors: list, slots: int) -> list:
        """[(flat buffer, [views of it, in the order of ``tensors``])], one per dtype, the first
        with ``slots`` more elements; tensors copied in where they are not those views already."""
        groups: dict = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        out, copies = [], []
        for g, (dtype, idx) in enumerate(groups.items()):
            sizes = [tensors[i].numel() for i in idx]
            flat = self._buffer(("reduce", bucket.index, g), sum(sizes) + (slots if g == 0 else 0), dtype,
                                tensors[0].device)
            views = list(flat[:sum(sizes)].split(sizes))
            copies += [(v, tensors[i]) for v, i in zip(views, idx) if tensors[i].data_ptr() != v.data_ptr()]
            out.append((flat, views))
        if copies:
            torch._foreach_copy_([v for v, _ in copies], [t for _, t in copies])
        return out

    def account(self, layer, msg, stats=None, counted: bool = True) -> None:
        """A layer's bytes (by kind), its dense bytes and its selected count, into ``stats``; a
        reduce-scatter bucket's bytes are counted in ``collect`` instead (``counted`` False), from
        what its two collectives moved."""
        stats = stats if stats is not None else self.stats
        group = "sparse" if layer.compressed else "dense"
        wire = msg.nbytes()
        if counted:
            stats.add_bytes(wire, group)
        stats.add("dense_bytes", 4 * layer.numel)
        if msg.selected is not None:
            for key, value in (("selected", msg.selected), ("k", msg.k)):
                stats.add(key, value)
                stats.add(f"{key}[{layer.name}]", value)
        stats.layer(layer.name, group, msg.selected, msg.k, sum(wire.values()), 4 * layer.numel)

    # -- receiving ------------------------------------------------------------------------
    def collect(self, state: StepState, compressor_for, into: dict, apply: dict) -> tuple[dict, list, list, list]:
        """Wait for every collective and decode: ({name: averaged flat gradient}, sparse updates,
        [non-finite counts, device tensors], [carried sums] or None).

        ``into``: {name: flat fp32 tensor} to decode into (saves a copy). ``apply``: {name: (flat
        parameter, lr)}: such allgather layers are not decoded here but returned as (layer,
        tensors, alpha) updates, applied to the weights once every check has passed."""
        out, updates, flags, carried = {}, [], [], None
        with self.stats.timer("communicate", "allreduce"):
            for b in self.buckets:
                if b.kind == "reduce":
                    for h in state.handles[b.index][1]:
                        self.comm.wait(h)   # in place: the sums are in the bucket's buffers
        scattered = [b for b in self.buckets if b.aggregation == REDUCE_SCATTER]
        if scattered:
            with self.stats.timer("communicate", "reduce_scatter"):
                self._reduce_scattered(state, scattered, flags)
        with self.stats.timer("communicate", "allgather"):
            gathered = [self._gathered(state, b, compressor_for) for b in self.buckets
                        if b.kind == "gather" and b.aggregation != REDUCE_SCATTER]
        with self.stats.timer("decompress", "allreduce"):
            for bucket in self.buckets:
                if bucket.kind == "reduce":
                    flats, _, msgs = state.handles[bucket.index]
                    sums = self._decode_fused(bucket, flats, msgs, compressor_for, into, out, flags)
                    carried = sums if bucket.index == self.carrier else carried
        with self.stats.timer("decompress", "reduce_scatter"):
            for bucket in scattered:
                self._finish_reduce_scatter(state, bucket, into, out)
        with self.stats.timer("decompress", "allgather"):
            for bucket, header, payload in gathered:
                self._decode_gather(compressor_for(bucket.layers[0]), bucket, header, payload, into, apply, out,
                                    updates, flags)
        return out, updates, flags, carried

    def _gathered(self, state: StepState, bucket: Bucket, compressor_for) -> tuple:
        """(bucket, gathered headers or None, payloads) once the bucket's allgathers are done."""
        header, data = state.handles[bucket.index]
        if header is ROWS:
            return (bucket, *self._open_rows(compressor_for(bucket.layers[0]), bucket, self.comm.wait(data)))
        if header is not None and not isinstance(header, torch.Tensor):
            header = self.comm.wait(header)
        return bucket, header, self.comm.wait(data)

    def _reduce_scattered(self, state: StepState, scattered: list, flags: list) -> None:
        """The owners' sums, bucket by bucket in order, then every bucket's kept entries in one
        allgather (one round, however many buckets); their non-finite counts into ``flags``."""
        pendings = [state.handles[b.index][0] for b in scattered]
        for b, pending in zip(scattered, pendings):
            self._reduce_scatters[b.index].reduce(pending)
        handle = reduce_scatter.allgather(self.comm, pendings, name="rsync.reselected")
        reduce_scatter.wait_allgather(self.comm, handle, pendings)
        flags += [self.comm.wait(state.handles[b.index][1]) for b in scattered]

    def _finish_reduce_scatter(self, state: StepState, bucket: Bucket, into: dict, out: dict) -> None:
        """A reduce-scatter bucket's averages (views of one flat buffer, copied into ``into`` where
        given), its bytes, and what no owner kept back into this rank's residuals (pending until
        the memory commits)."""
        rsc = self._reduce_scatters[bucket.index]
        flat = self._buffer(("scatter", bucket.index), sum(rsc.numels), torch.float32, bucket.layers[0].device)
        got = rsc.finish(state.handles[bucket.index][0], out=flat.zero_())
        self.stats.add_bytes({"alltoall": got.bytes["alltoall_sent"], "reselected": got.bytes["allgather_sent"]},
                             "sparse")
        for layer, average, (positions, values) in zip(bucket.layers, got.averages, got.carry):
            target = into.get(layer.name)
            out[layer.name] = target.copy_(average) if target is not None else average
            residual = state.kept.get(layer.name)
            if residual is not None and positions.numel():
                residual.index_add_(0, positions.to(residual.device), values.to(residual))

    def _decode_fused(self, bucket: Bucket, flats: list, msgs: list, compressor_for, into: dict, out: dict,
                      flags: list):
        """A reduce bucket's sums: 1. the values part divided by N (the average); 2. its count of
        non-finite inputs into ``flags``, the carried sums returned; 3. each layer's average: its
        view itself (fp32 dense), copied into ``into`` where given, or decoded by its compressor."""
        size = self.comm.size
        first, _ = flats[0]
        n = sum(v.numel() for v in flats[0][1])
        for flat, views in flats:                                                                   # 1.
            flat[:sum(v.numel() for v in views)].div_(size)
        flags.append(first[n:n + 1])                                                                # 2.
        carried = first[n + 1:] if first.numel() > n + 1 else None
        views = iter([v for _, vs in flats for v in vs])
        copies = []
        for layer, msg in zip(bucket.layers, msgs):                                                 # 3.
            comp = compressor_for(layer)
            msg_views = [next(views) for _ in msg.tensors]
            if type(comp) is NoneCompressor and msg_views[0].dtype == torch.float32:
                target = into.get(layer.name)
                if target is not None and target.data_ptr() != msg_views[0].data_ptr():
                    copies.append((target, msg_views[0]))
                out[layer.name] = target if target is not None else msg_views[0]
            else:
                buf = self._zeroed(layer, msg_views[0].device, into)
                comp.decompress_add(buf, msg_views, layer, ctx=msg.ctx)
                out[layer.name] = buf
        if copies:
            torch._foreach_copy_([t for t, _ in copies], [v for _, v in copies])
        return carried

    def _decode_gather(self, comp, bucket: Bucket, header, payload, into, apply, out, updates, flags) -> None:
        """1. cut every rank's message out of the payload (by its header, or by the sizes known in
        advance) and take its non-finite count; 2. layers to apply to the weights become updates;
        3. the compressor decodes the others into zeroed buffers (the caller's ``into``, or views of
        one flat buffer)."""
        size, layers, plan = self.comm.size, bucket.layers, self.plans.get(bucket.index)
        dtypes = comp.bucket_dtypes(layers) + [torch.int32]
        if header is None:                                                                          # 1.
            counts = plan.wire_counts() if plan is not None else list(comp.fixed_bucket_counts(layers)) + [1]
            per_rank = unpack_fixed(payload, counts, dtypes, size)
        else:
            per_rank = unpack_gathered(header, payload, dtypes, size)
        flags.append(torch.cat([p[-1] for p in per_rank]))
        per_rank = [p[:-1] for p in per_rank]
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
        frame = None
        if comp.decodes_flat(layers) and not applied:                                               # 3.
            frame = plan.frame if plan is not None else comp.segments(list(layers))
        flat = self._flat(bucket, frame) if frame is not None else None
        if flat is not None:
            bufs = dict(zip((l.name for l in layers), layer_views(flat, frame)))
            comp.decompress_bucket(None, per_rank, layers, alpha=alpha, flat=flat)
        else:
            bufs = {l.name: self._zeroed(l, l.device, into) for l in layers if l.name not in apply}
            comp.decompress_bucket(bufs, per_rank, layers, alpha=alpha)
        if not exact_scale:
            for t in ([flat] if flat is not None else bufs.values()):
                t.div_(size)
        out.update(bufs)

    # -- buffers ----------------------------------------------------------------------------
    def _buffer(self, key, n: int, dtype, device) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != n or buf.dtype != dtype or buf.device != torch.device(device):
            buf = torch.zeros(n, dtype=dtype, device=device)
            if self.reuse_buffers:
                self._buffers[key] = buf
        return buf

    def _flat(self, bucket: Bucket, frame) -> torch.Tensor:
        """One zeroed fp32 buffer for a bucket decoded flat, laid out by ``frame`` (its layers'
        averages are views)."""
        return self._buffer(("bucket", bucket.index), frame.n, torch.float32, bucket.layers[0].device).zero_()

    def _zeroed(self, layer, device, into: dict) -> torch.Tensor:
        target = into.get(layer.name)
        if target is not None and target.device == torch.device(device):
            return target.zero_()
        return self._buffer(layer.name, layer.numel, torch.float32, device).zero_()
