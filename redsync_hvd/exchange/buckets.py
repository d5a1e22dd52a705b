"""A bucket: layers that travel as one collective, and own it.

Every layer belongs to one bucket, fixed when the exchange is built (``core/layout.py``, the same
partition the cost model prices, identical on every rank), and each bucket's kind is chosen then:

* :class:`ReduceBucket`: messages of one shape on every rank (dense gradients, fp16 values,
  random-k's and IWP's values, PowerSGD's factors), back to back in one flat buffer per dtype,
  summed by one allreduce each;
* :class:`GatherBucket`: compressed messages that differ per rank (own positions, own counts),
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

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..comm.packing import pack, payload_bytes, unpack_fixed, unpack_gathered
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
    values = torch.cat([e.reshape(-1).float() for e in evidence])
    return ((~torch.isfinite(values)).sum(dtype=torch.float32) + extra).reshape(1)


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
            flat = grad.detach().reshape(-1)   # (a gradient that landed in its bucket has its flat view ready)
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
    """
    kind = "reduce"

    def __init__(self, *args, carrier: bool = False, passthrough: bool = False, momentum: bool = False, **kw):
        super().__init__(*args, **kw)
        self.carrier, self.passthrough, self.momentum = carrier, passthrough, momentum
        self.slots = 1 + (CARRY_SLOTS if carrier else 0)

    def clear(self) -> None:
        super().clear()
        self._flats, self._started, self._sent = [], [], []

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
        if self.carrier:
            carry = st.carry or []   # from pinned memory: a pageable copy would wait for the stream
            first[n + 1:].copy_(to_device(torch.tensor(carry + [0.0] * (self.slots - 1 - len(carry)),
                                                       dtype=first.dtype), first.device))
        self.stats.add_bytes({"scalars": 4})   # the count; carried values are the caller's traffic
        self._started = [self.comm.allreduce_async_(flat, name=f"{self.name}.{i}", average=False)
                         for i, (flat, _) in enumerate(flats)]                                      # 3.
        self._flats, self._sent = flats, messages

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


class Sizes(enum.Enum):
    """How every rank of a gather bucket learns the others' message sizes."""
    FIXED = "fixed"     # the counts are known before the step on every rank: no header
    ROWS = "rows"       # torch.distributed with a bounded message: one row of that capacity, sizes inside
    HEADER = "header"   # a fixed-size header of the counts, allgathered beside the payload (on
    #                     torch.distributed, which needs every rank's size first, read before it)


@dataclass
class InFlight:
    """A gather bucket's collectives between ``_start`` and ``finish``: the payload's (or capacity
    rows') allgather, and the header's: still in flight (``header``), already read (``headers``,
    torch.distributed reads them first), or neither (fixed sizes, rows)."""
    data: Any
    header: Any = None
    headers: Optional[torch.Tensor] = None


class GatherBucket(Bucket):
    """Per-rank messages, packed into one payload and allgathered.

    wire: how every rank learns the sizes (:class:`Sizes`), chosen once from the compressor's ``wire``.
    """
    kind = "gather"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        wires = [self.compressor.wire(l) for l in self.layers]
        self.dtypes = [d for w in wires for d in w.dtypes] + [torch.int32]
        needs_sizes = getattr(self.comm, "needs_sizes", False)
        if all(w.fixed for w in wires):
            self.wire = Sizes.FIXED
        elif needs_sizes and all(w.capacity is not None for w in wires):
            self.wire = Sizes.ROWS
        else:
            self.wire = Sizes.HEADER

    @property
    def control_bytes(self) -> int:
        return 4 if self.wire is Sizes.FIXED else 8   # the count, and its size in the header

    def clear(self) -> None:
        super().clear()
        self._flight: InFlight | None = None
        self._sent = []

    def _start(self, st: StepState, messages: list) -> None:
        """1. the wire tensors and the count of non-finite inputs; 2. the sizes: none (fixed), in a
        capacity row, or a header allgather (read now where the transport needs sizes first);
        3. the payload's allgather."""
        tensors = [t for m in messages for t in m.tensors] + [self._count(messages).to(torch.int32)]   # 1.
        header, payload = pack(tensors, device=self.layers[0].device)
        size, sizes = self.comm.size, None
        self._sent = messages
        if self.wire is Sizes.ROWS:                                                                      # 2.
            self.stats.add_bytes({"headers": header.numel() * 4, "scalars": 4})
            row = self._capacity_row(header, payload)
            self._flight = InFlight(self.comm.allgather_async(row, name=self.name, sizes=[row.numel()] * size))
            return
        flight = InFlight(None)
        if self.wire is Sizes.FIXED:
            counts = self._counts()
            if [t.numel() for t in tensors] != counts:
                raise RuntimeError(f"{type(self.compressor).__name__} declared fixed message sizes {counts[:-1]} "
                                   f"for bucket {self.index} but sent {[t.numel() for t in tensors[:-1]]}")
            sizes = [payload.numel()] * size
        else:
            self.stats.add_bytes({"headers": header.numel() * 4})
            flight.header = self.comm.allgather_async(header, name=f"{self.name}.hdr", sizes=[header.numel()] * size)
            if getattr(self.comm, "needs_sizes", False):
                flight.headers, flight.header = self.comm.wait(flight.header), None
                sizes = [payload_bytes(c, self.dtypes) for c in flight.headers.view(size, -1).tolist()]
        self.stats.add_bytes({"scalars": 4})
        flight.data = self.comm.allgather_async(payload, name=self.name, sizes=sizes)                     # 3.
        self._flight = flight

    def _counts(self) -> list:
        return [n for l in self.layers for n in self.compressor.wire(l).counts] + [1]

    def _capacity_row(self, header: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """[the header's int32 counts | the payload | zeros up to the capacity's payload], uint8: the
        same size on every rank, so one allgather carries sizes and data (``_open_rows`` cuts it)."""
        capacity = [n for l in self.layers for n in self.compressor.wire(l).capacity]
        if any(int(c) > cap for c, cap in zip(header.tolist(), capacity)):
            raise RuntimeError(f"{type(self.compressor).__name__} declared at most {capacity} elements per wire "
                               f"tensor for bucket {self.index} but sent {header.tolist()[:-1]}")
        most = payload_bytes(capacity + [1], self.dtypes)
        row = torch.zeros(4 * header.numel() + most, dtype=torch.uint8, device=payload.device)
        row[:4 * header.numel()] = header.to(payload.device).view(torch.uint8)
        row[4 * header.numel():4 * header.numel() + payload.numel()] = payload
        return row

    def _open_rows(self, rows: torch.Tensor) -> tuple:
        """Every rank's capacity row -> (the gathered headers, the payloads back to back)."""
        rows = rows.view(self.comm.size, -1)
        width = 4 * len(self.dtypes)
        header = rows[:, :width].contiguous().view(torch.int32).reshape(-1)
        counts = header.view(self.comm.size, -1).tolist()
        payload = torch.cat([rows[r, width:width + payload_bytes(c, self.dtypes)] for r, c in enumerate(counts)])
        return header, payload

    def _wait(self) -> tuple:
        """(the gathered headers, or None where the sizes are fixed or inside the rows; the gathered
        payload or rows)."""
        flight = self._flight
        headers = flight.headers if flight.header is None else self.comm.wait(flight.header)
        return headers, self.comm.wait(flight.data)

    def _arrived(self, header, payload) -> list:
        """Every rank's wire tensors, cut out of the gathered payload (by its header, or by the sizes
        known in advance)."""
        if self.wire is Sizes.ROWS:
            header, payload = self._open_rows(payload)
        if self.wire is Sizes.FIXED:
            return unpack_fixed(payload, self._counts(), self.dtypes, self.comm.size)
        return unpack_gathered(header, payload, self.dtypes, self.comm.size)

    def finish(self, into: dict, apply: dict) -> Arrived:
        """1. every rank's message and non-finite count; 2. layers to apply to the weights become
        updates; 3. the others decoded into zeroed buffers (``into``'s where given), rank by rank."""
        with self.stats.timer("communicate", "allgather"):
            gathered = self._wait()
        with self.stats.timer("decompress", "allgather"):
            per_rank = self._arrived(*gathered)                                                     # 1.
            got = Arrived(flags=torch.cat([p[-1] for p in per_rank]))
            size = self.comm.size
            # a power-of-two size scales each term exactly (subnormals aside), so adding v/size
            # equals dividing the sum bit for bit, and saves a pass over every output
            exact = size & (size - 1) == 0
            alpha = 1.0 / size if exact else 1.0
            out = {l.name: self.buffers.zeroed(l, into) for l in self.layers if l.name not in apply}
            for tensors in per_rank:
                at = 0
                for layer in self.layers:
                    n = len(self.compressor.wire(layer).dtypes)
                    part, at = tensors[at:at + n], at + n
                    if layer.name in apply:                                                         # 2.
                        got.updates.append((layer, part, -apply[layer.name][1] / size))
                    else:                                                                           # 3.
                        self.compressor.decompress_add(out[layer.name], part, layer, alpha=alpha)
            if not exact:
                for t in out.values():
                    t.div_(size)
            got.averages.update(out)
        return got
