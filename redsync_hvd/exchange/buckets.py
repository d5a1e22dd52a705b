"""A bucket: layers that travel as one collective, and own it.

Every layer belongs to one bucket, fixed when the exchange is built (``core/layout.py``, the same
partition the cost model prices, identical on every rank), and each bucket's kind is chosen then:

* :class:`ReduceBucket`: messages of one shape on every rank (dense gradients, fp16 values,
  random-k's and IWP's values, PowerSGD's factors), back to back in one flat buffer per dtype,
  summed by one allreduce each;
* ``GatherBucket`` (gather.py): compressed messages that differ per rank (own positions, own counts),
  packed into one byte payload (``comm/packing.py``) and allgathered, with a header of their sizes
  where those vary (or, on torch.distributed, one row of a bounded size);
* ``PlannedBucket`` (planned.py): exactly k per layer on the device, one flat buffer;
* ``ScatterBuckets`` (scatter.py): the sparse reduce-scatter.

A gradient enters through ``add``. Once its unit is in (the layer, or the whole bucket where the
compressor selects by bucket), GRACE's steps run (:meth:`Bucket.encode`):

    c = memory.compensate(name, g, compressor.first_pass(layer, step))   1. x = r + g
    msg = compressor.compress(c.x, layer, step, c.first)                 2. what goes on the wire
    memory.update(layer, c.x, msg, compressor)                           3. x -= decode(msg)
    self._start(...)  once every layer's message is in                   4. the bucket's collective

``finish`` waits for the collective, decodes and returns :class:`~.step.Arrived`. Each bucket also
carries its layers' count of non-finite inputs in that collective, so the step's agreement that
every rank's input was finite costs no collective of its own.
"""
from __future__ import annotations

import torch

from ..compressors.base import Message
from ..core.segments import to_device
from ..core.select import NonFiniteError
from ..core.wire import finite_evidence
from .step import Arrived, StepState

CARRY_SLOTS = 8   # the carrier bucket's room for the caller's carry values (the runner sends 3)


def nonfinite_count(evidence: list, extra: int = 0, device=None) -> torch.Tensor:
    """(1,) float32 on the device: how many of ``evidence`` (device scalars or vectors: sums,
    norms, flags with inf where set) are not finite, plus ``extra`` known on the host."""
    if not evidence:
        return torch.full((1,), float(extra), device=device)
    values = evidence[0].reshape(-1) if len(evidence) == 1 else torch.cat([e.reshape(-1).float() for e in evidence])
    count = (~torch.isfinite(values)).sum(dtype=torch.float32)
    return (count + extra if extra else count).reshape(1)


def account(stats, layer, msg, counted: bool = True) -> None:
    """A layer's bytes (by kind), its dense bytes and its selected count, into ``stats``."""
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


class Buffers:
    """Buffers that live across steps. A fresh CPU tensor of tens of MB is mmapped and page-faulted
    in on every step (several times the cost of filling a warm one), so outputs and fused buffers
    are allocated once; what ``finish`` returns is then valid until the next step. ``keep`` False
    (a TF tensor sharing the memory through DLPack keeps it longer) allocates every time."""

    def __init__(self, keep: bool = True):
        self.keep, self._held = keep, {}

    def get(self, key, n: int, dtype, device) -> torch.Tensor:
        buf = self._held.get(key)
        if buf is None or buf.numel() != n or buf.dtype != dtype or buf.device != torch.device(device):
            buf = torch.zeros(n, dtype=dtype, device=device)
            if self.keep:
                self._held[key] = buf
        return buf

    def zeroed(self, layer, into: dict) -> torch.Tensor:
        """The layer's output, zeroed: the caller's ``into`` tensor where given, else a held one."""
        target = into.get(layer.name)
        if target is not None and target.device == torch.device(layer.device):
            return target.zero_()
        return self.get(layer.name, layer.numel, torch.float32, layer.device).zero_()


class Bucket:
    """What every bucket of per-layer messages shares: its layers, their compressor and memory,
    the unit they are compressed in, and steps 1-3. Subclasses own step 4 and ``finish``.

    evidence: each layer needs its own finite check (a pass for its largest magnitude; False where
        the compressor checks itself or the bucket's collective sees every value as it is).
    together: the whole bucket is one unit (``compress_bucket`` once its last gradient is in).
    blocking: the compressor waits on collectives of its own: the bucket is compressed in
        ``flush``, called by ``finish()`` in a fixed order, never from a hook, where ranks whose
        backward passes produce gradients in different orders could deadlock.
    """
    kind = ""   # each kind's own: "reduce", "gather", "scatter", "planned"
    ride = None     # a reduce bucket's GatherBucket, where it rides in that allgather (ReduceBucket)
    riders = ()     # a gather bucket's reduce buckets riding in its allgather (GatherBucket.take_rider)

    def __init__(self, index: int, layers: tuple, compressor, memory, comm, stats, policy, buffers: Buffers, *,
                 evidence: bool, clip: float | None, together: bool = False):
        self.index, self.layers = index, tuple(layers)
        self.name = f"rsync.{self.kind}{index}"   # its collectives' name, the same on every rank
        self.names = [l.name for l in self.layers]
        self.compressor, self.memory = compressor, memory
        self.comm, self.stats, self.policy, self.buffers = comm, stats, policy, buffers
        self.evidence, self.clip = evidence, clip
        self.blocking = compressor.blocking
        self.together = together or self.blocking
        self.group = "sparse" if self.layers[0].compressed else "dense"
        self.landing: dict = {}   # {name: flat view} where gradients land (the adapter's .grad)
        self.clear()

    @property
    def control_bytes(self) -> int:
        """What this bucket sends each step besides its messages: its count of non-finite inputs."""
        return 4

    def clear(self) -> None:
        """Forget this step (after ``finish``, or when the step is aborted)."""
        self._inputs, self._messages = {}, {}
        self._trace, self._evidence = [], []
        self._aggregate: dict = {}

    # -- steps 1-3, as gradients arrive -------------------------------------------------------
    def add(self, layer, grad: torch.Tensor, st: StepState) -> None:
        """One layer's gradient; its unit runs once complete, the collective once all are in."""
        self._inputs[layer.name] = grad
        if self.blocking:
            return
        if not self.together:
            self._run((layer,), st)
        elif len(self._inputs) == len(self.layers):
            self._run(self.layers, st)

    def flush(self, st: StepState) -> None:
        """A blocking bucket's unit, in registration order (PowerSGD draws its Qs in that order)."""
        self._run(tuple(sorted(self.layers, key=lambda l: l.index)), st)

    def _run(self, layers: tuple, st: StepState) -> None:
        with self.stats.timer("select", self.group):
            grads = [self.prepare(l, self._inputs[l.name], st) for l in layers]
            messages = self.encode(layers, grads, st)
        for layer, msg in zip(layers, messages):
            self._messages[layer.name] = msg
            self._account(layer, msg)
        if len(self._messages) == len(self.layers):
            self._start(st, [self._messages[n] for n in self.names])                        # 4. send

    def _account(self, layer, msg) -> None:
        account(self.stats, layer, msg)

    def encode(self, layers: tuple, grads: list, st: StepState) -> list:
        """Steps 1-3 for one unit; returns its messages."""
        comp, memory = self.compressor, self.memory
        cs = [memory.compensate(l.name, g, comp.first_pass(l, st.step)) for l, g in zip(layers, grads)]  # 1.
        self.policy.observe(list(layers), [c.x for c in cs], st.step, grads)   # policy.mode budget only
        messages = self._compress(layers, grads, cs, st)                                          # 2.
        if comp.error_feedback == "aggregate":   # x -= the average, once it arrived
            self._aggregate.update((l.name, c.x) for l, c in zip(layers, cs))
            return messages
        for layer, c, msg in zip(layers, cs, messages):
            memory.update(layer, c.x, msg, comp)                                                  # 3.
        return messages

    def _compress(self, layers: tuple, grads: list, cs: list, st: StepState) -> list:
        comp = self.compressor
        if len(layers) > 1 or self.together:
            messages = comp.compress_bucket([c.x for c in cs], list(layers), st.step, [c.first for c in cs])
            for layer, msg in zip(layers, messages):
                if msg.nonfinite is not None:   # a device flag: counted by the bucket
                    self._trace.append(((layer.name,), msg.nonfinite.reshape(1)))
            return messages
        (layer,), (c,) = layers, cs
        try:
            return [comp.compress(c.x, layer, st.step, c.first)]
        except NonFiniteError:
            # keep the collective well formed: compress the residual alone; finish() fails the step
            # (check_finite) or passes NaN on for the layer
            cs[0] = self.memory.compensate(layer.name, torch.zeros_like(grads[0]))
            msg = comp.compress(cs[0].x, layer, st.step)
            msg.nonfinite = torch.ones((), dtype=torch.bool, device=c.x.device)   # the bucket's collective counts it
            self._trace.append(((layer.name,), msg.nonfinite.reshape(1)))
            return [msg]

    def prepare(self, layer, grad: torch.Tensor, st: StepState) -> torch.Tensor:
        """Flat fp32 gradient (fp16/bf16 accepted), unscaled, locally clipped; finite evidence."""
        flat = self.landing.get(layer.name)
        if flat is None or flat.data_ptr() != grad.data_ptr() or flat.dtype != grad.dtype:
            # (a gradient that landed in its bucket has its flat view ready)
            flat = (grad.detach() if grad.requires_grad else grad).reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.float()
        if st.grad_scale is not None:
            flat = flat / st.grad_scale
        if self.evidence:   # its largest magnitude: a sum would overflow on huge finite values
            value = finite_evidence(flat)
            self._trace.append(((layer.name,), value))
            self._evidence.append(value)
        if self.clip is not None:   # on the device, no host read: a factor of 1.0 leaves the values bit for bit
            flat = flat * (self.clip / flat.norm().clamp(min=1e-30)).clamp(max=1.0)
        return flat

    def _count(self, messages: list) -> torch.Tensor:
        """This rank's count of non-finite inputs: the messages' flags and the evidence."""
        flags = [torch.where(m.nonfinite, torch.inf, 0.0) for m in messages if m.nonfinite is not None]
        return nonfinite_count(flags + self._evidence, 0, self.layers[0].device)

    def flagged(self) -> list:
        """The layers this rank knows held NaN/Inf this step (to name them when the step fails)."""
        def bad(v):   # a flag (bool: set where bad), or evidence (not finite where bad)
            return v.reshape(-1) if v.dtype == torch.bool else ~torch.isfinite(v.reshape(-1).float())
        return [n for names, v in self._trace for n, b in zip(names, bad(v).tolist()) if b]

    def aggregate_feedback(self, averages: dict) -> None:
        """PowerSGD's error feedback: x -= the decoded average, for the layers it kept x of."""
        for name, x in self._aggregate.items():
            self.memory.update_aggregate(name, x, averages[name])

    def _start(self, st: StepState, messages: list) -> None:
        raise NotImplementedError

    def finish(self, into: dict, apply: dict) -> Arrived:
        raise NotImplementedError


class ReduceBucket(Bucket):
    """Messages of one shape on every rank, summed by one in-place allreduce per dtype.

    carrier: the first reduce bucket also sums the caller's carry values (the runner's stop
        flags) in slots after its count of non-finite inputs.
    passthrough: the layers' messages are their fp32 gradients themselves (dense fp32): the
        average is the bucket's view, nothing is decoded.
    momentum: the dense layers' averages get DGC momentum after the finite check (their
        velocities live in the memory; ``memory.dense_momentum``).
    ride: a ``GatherBucket`` (gather.py) whose allgather carries this bucket's flat buffers in place of an
        allreduce of its own (``policy.dense_in_gather_bytes``); each rank then sums the N rows.
    """
    kind = "reduce"

    def __init__(self, *args, carrier: bool = False, passthrough: bool = False, momentum: bool = False, **kw):
        super().__init__(*args, **kw)
        self.carrier, self.passthrough, self.momentum = carrier, passthrough, momentum
        self.slots = 1 + (CARRY_SLOTS if carrier else 0)
        self.ride = None   # the GatherBucket it rides in, if any (gather.py:GatherBucket.take_rider)
        self.seat = slice(0)   # where, riding, its flat buffers sit among that bucket's rider tensors

    def clear(self) -> None:
        super().clear()
        self._flats, self._started, self._sent = [], [], []

    def flat_sizes(self) -> list:
        """[(dtype, elements)] of the flat buffers ``_start`` fills, the first with the slots: what a
        bucket riding an allgather adds to its payload."""
        sizes: dict = {}
        for layer in self.layers:
            wire = self.compressor.wire(layer)
            for dtype, count in zip(wire.dtypes, wire.counts):
                sizes[dtype] = sizes.get(dtype, 0) + count
        return [(d, n + (self.slots if g == 0 else 0)) for g, (d, n) in enumerate(sizes.items())]

    def encode(self, layers: tuple, grads: list, st: StepState) -> list:
        """A passthrough bucket's messages are its gradients (no memory, nothing to compress)."""
        if self.passthrough:
            return [Message([g], ("values",)) for g in grads]
        return super().encode(layers, grads, st)

    def gradient_views(self, device) -> dict:
        """{name: the layer's view of the bucket's fused fp32 buffer}: where a passthrough bucket's
        gradients should land, so ``_start`` copies nothing in."""
        sizes = [l.numel for l in self.layers]
        flat = self.buffers.get(("reduce", self.index, 0), sum(sizes) + self.slots, torch.float32, device)
        self.landing = dict(zip(self.names, flat[:sum(sizes)].split(sizes)))
        return self.landing

    def _start(self, st: StepState, messages: list) -> None:
        """1. the messages into the flat buffers (one per dtype; tensors already there are not
        copied); 2. the first buffer's slots: the count of non-finite inputs (evidence and the
        buffer's own norm) and the carry values; 3. one in-place sum allreduce per buffer."""
        tensors = [t if t.dim() == 1 else t.reshape(-1) for m in messages for t in m.tensors]
        flats = self._fused(tensors)                                                                # 1.
        first = flats[0][0]
        n = first.numel() - self.slots
        self._evidence.append(finite_evidence(first[:n]))
        first[n:n + 1] = nonfinite_count(self._evidence)                                            # 2.
        if self.carrier and not st.carry:
            first[n + 1:].zero_()
        elif self.carrier:   # from pinned memory: a pageable copy would wait for the stream
            carry = st.carry
            first[n + 1:].copy_(to_device(torch.tensor(carry + [0.0] * (self.slots - 1 - len(carry)),
                                                       dtype=first.dtype), first.device))
        self.stats.add_bytes({"scalars": 4})   # the count; carried values are the caller's traffic
        self._flats, self._sent = flats, messages
        if self.ride is not None:   # 3. inside the gather bucket's allgather, once both are ready
            self.ride.rider_loaded(self)
            return
        self._started = [self.comm.allreduce_async_(flat, name=f"{self.name}.{i}", average=False)
                         for i, (flat, _) in enumerate(flats)]                                      # 3.

    def _fused(self, tensors: list) -> list:
        """[(flat buffer, [views of it, in the order of ``tensors``])], one per dtype, the first
        with the slots; tensors copied in where they are not those views already."""
        groups: dict = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        out, copies = [], []
        for g, (dtype, idx) in enumerate(groups.items()):
            sizes = [tensors[i].numel() for i in idx]
            flat = self.buffers.get(("reduce", self.index, g), sum(sizes) + (self.slots if g == 0 else 0), dtype,
                                    tensors[0].device)
            views = list(flat[:sum(sizes)].split(sizes))
            copies += [(v, tensors[i]) for v, i in zip(views, idx) if tensors[i].data_ptr() != v.data_ptr()]
            out.append((flat, views))
        if copies:
            torch._foreach_copy_([v for v, _ in copies], [t for _, t in copies])
        return out

    def finish(self, into: dict, apply: dict) -> Arrived:
        """1. wait; the values divided by N (the average); 2. the count of non-finite inputs and the
        carried sums; 3. each layer's average: its view itself (passthrough), copied into ``into``
        where given, or decoded by the compressor."""
        with self.stats.timer("communicate", "allreduce"):
            for handle in self._started:
                self.comm.wait(handle)   # in place: the sums are in the buffers
        with self.stats.timer("decompress", "allreduce"):
            if self.ride is not None:   # every rank's rows, in rank order: their sum into the buffers
                for g, (flat, _) in enumerate(self._flats):
                    rows = [r[g] for r in self.ride.rider_rows(self)]
                    flat.copy_(rows[0])
                    for row in rows[1:]:
                        flat.add_(row)
            first, _ = self._flats[0]
            n = first.numel() - self.slots
            for flat, views in self._flats:                                                         # 1.
                flat[:sum(v.numel() for v in views)].div_(self.comm.size)
            got = Arrived(flags=first[n:n + 1], carried=first[n + 1:] if self.carrier else None,      # 2.
                          momentum=list(self.names) if self.momentum else [])
            self._decode(into, got.averages)                                                        # 3.
            self.aggregate_feedback(got.averages)
        return got

    def _decode(self, into: dict, out: dict) -> None:
        views = iter([v for _, vs in self._flats for v in vs])
        copies = []
        for layer, msg in zip(self.layers, self._sent):
            parts = [next(views) for _ in msg.tensors]
            if self.passthrough:
                target = into.get(layer.name)
                if target is not None and target.data_ptr() != parts[0].data_ptr():
                    copies.append((target, parts[0]))
                out[layer.name] = target if target is not None else parts[0]
            else:
                buf = self.buffers.zeroed(layer, into)
                self.compressor.decompress_add(buf, parts, layer, ctx=msg.ctx)
                out[layer.name] = buf
        if copies:
            torch._foreach_copy_([t for t, _ in copies], [v for _, v in copies])
