"""The compressed reduce-scatter of one flat group of sharded parameters (FSDP2, ``torch/fsdp.py``).

FSDP2 reduces a parameter group's gradients in one reduce-scatter of a flat, padded buffer of
N rows: row o holds, for every parameter j of the group, the o-th of its N equal dim-0 pieces
(``s_j`` elements, zero-padded), and rank o receives the sum of row o over ranks: the gradient
of the shard its optimizer updates. Here the same buffer travels compressed (``ShardedGroup``):

    1. compensate  x = r + g (DGC: r + u, u = m u + g) of every other rank's row, fused with the
                   row's first histogram                                 compensate
    2. select      exactly k of every piece (o, j) of those rows (k = ceil(d * the piece's real
                   elements)); x -= what the owner decodes, the velocity zeroed there (DGC's
                   masking)                                              select(update=True)
    3. route       the selected entries to their owners by the sparse reduce-scatter's alltoall,
                   with FSDP's contiguous shards as the owners (reduce_scatter.py: ``Shards``);
                   each owner adds up what it received                   SparseReduceScatter
    4. own row     this rank's own row needs no wire and no selection: the owner adds all of
                   r + g (DGC: r + u, the velocity unmasked), and its residual becomes 0
    5. dense       parameters the policy leaves dense (biases) travel in one dense reduce-scatter
                   of their pieces (fp16 under policy.dense_values: fp16); x = 0 there. Under
                   dense_values: int8 they travel as codes by an alltoall instead, and x keeps
                   what the codes round off (``dense_wire.py``)

Every entry sent is delivered: FSDP has no second phase, so an owner keeps the whole sum of its
shard (the DDP/Horovod ``sparse_reduce_scatter`` keeps only ceil(k/N) per layer of it). The new
residual is exactly what was not delivered: sent + new residual = old residual + gradient, with
fp16 values' and int8 codes' rounding and sign-mean's error left in the residual (step 2
subtracts what the owner decodes). Positions travel as int32 or, Golomb-coded, as places in the
owner's shard (``scatter_wire.py``); either way the owner sums the same entries. Groups whose
parameters all go dense take FSDP's own reduce-scatter (and, under momentum correction, a
shard-sized velocity applied to the average).

Memory per rank: a residual of the unsharded group's size, double-buffered (a step writes the
spare; ``commit`` at the step's end swaps, ``rollback`` drops it: a NaN on any rank leaves the
state as it was); with DGC the velocity likewise. ``residual_dtype: bf16`` stores both in bf16
(each step accumulates in fp32 in one scratch buffer of the largest group). docs/fsdp.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..compressors.codec import MessageCodec
from ..core.compensate import corrected, torch_compensate, velocity
from ..core.layout import k_of
from ..core.segments import Segments
from ..core.select import Contract, HistogramRequest, compensate, select
from ..memory.state import Block, Carried, Pair
from .dense_wire import dense_wire
from .reduce_scatter import SparseReduceScatter
from .regions import Shards

MAX_LAYOUTS = 16        # layouts (k per piece) kept with their tables: a warm-up changes k a few times
STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ShardLayout:
    """The flat buffer of one FSDP group on ``size`` ranks: parameter j's piece for owner o is
    ``flat[o * row + offsets[j] : ... + shards[j]]``; ``numels[j]`` of its elements are real
    (dim-0 padding makes the last pieces short)."""

    def __init__(self, shards: list, numels: list, size: int, rank: int):
        self.shards, self.numels = tuple(int(s) for s in shards), tuple(int(n) for n in numels)
        self.size, self.rank = int(size), int(rank)
        self.offsets = [0]
        for s in self.shards:
            self.offsets.append(self.offsets[-1] + s)
        self.row = self.offsets[-1]
        self.numel = self.size * self.row
        self._segments: dict = {}

    def real(self, owner: int, j: int) -> int:
        return max(0, min(self.shards[j], self.numels[j] - owner * self.shards[j]))

    def segments(self, owner: int, densities: list) -> Segments:
        """Owner ``owner``'s row: parameter j's piece with k = ceil(d_j * its real elements) for a
        compressed parameter (``densities[j]`` None: dense, k = 0); cached per k."""
        ks = tuple(0 if d is None else k_of(self.real(owner, j), d) for j, d in enumerate(densities))
        seg = self._segments.get(ks)
        if seg is None:
            seg = self._segments[ks] = Segments(self.shards, ks)
            if len(self._segments) > MAX_LAYOUTS:
                self._segments.pop(next(iter(self._segments)))
        return seg

    def rows(self) -> list:
        """(owner, its row's slice of the flat buffer) for every other rank."""
        return [(o, slice(o * self.row, (o + 1) * self.row)) for o in range(self.size) if o != self.rank]

    def own(self) -> slice:
        return slice(self.rank * self.row, (self.rank + 1) * self.row)


# each message.quantize a group sends, as the cost model names its format (policy/costmodel.py:
# sharded_group_time prices a group's reduce-scatter by it)
MESSAGE_FORMATS = {"none": "pairs", "fp16": "pairs_fp16", "int8": "pairs_int8", "sign_mean": "sign_mean"}


def message_format(quantize: str, index_coding: str = "raw") -> str:
    """The cost model's name for a group's message: ``MESSAGE_FORMATS``, Golomb-coded or not."""
    base = MESSAGE_FORMATS[quantize]
    if index_coding != "golomb":
        return base
    return "golomb" if base == "sign_mean" else f"golomb_{base}"

KINDS = ("residual", "velocity", "dense_velocity")   # what a group carries (memory/state.py)

@dataclass
class GroupStep:
    """What one group's reduce-scatter did this step: its non-finite flag (a device tensor, read
    once per step) and its bytes (this rank's share of each collective, self excluded)."""
    bad: torch.Tensor
    sent: int = 0
    received: int = 0
    dense: int = 0
    kinds: dict = field(default_factory=dict)


@dataclass
class Settings:
    """What every group of one exchange shares: the message codec per group comes from the layers."""
    momentum: float = 0.0          # DGC momentum correction (0: none)
    nesterov: bool = False
    masking: bool = True
    storage: str = "fp32"          # residual_dtype
    backend: str = "auto"          # radix select backend
    check_finite: bool = True
    dense_values: str = "fp32"     # policy.dense_values: fp32, fp16 (the dense reduce-scatters), int8 (codes)


class ShardedGroup:
    """One FSDP group's compressed reduce-scatter and its per-rank state (module docstring).

    layers: the group's parameters as the policy sees them (``Layer``: name, unsharded numel,
    ``compressed``, density); shards: each one's padded piece size; quantize: the group's message
    ("none", "fp16", "int8" or "sign_mean"), sign_rule; index_coding: "raw" (int32 positions) or
    "golomb" (each owner's share as the Golomb-Rice code of its places in the owner's shard,
    ``scatter_wire.py``); comm: alltoall_async, reduce_scatter_async, wait."""

    def __init__(self, name: str, layers: list, shards: list, comm, settings: Settings,
                 quantize: str = "none", sign_rule: str = "alternate", device="cpu", carried: Carried | None = None,
                 index_coding: str = "raw"):
        self.name, self.layers, self.comm, self.settings = name, list(layers), comm, settings
        self.layout = ShardLayout(shards, [l.numel for l in layers], comm.size, comm.rank)
        self.compressed = [j for j, l in enumerate(self.layers) if l.compressed]
        self.dense = [j for j, l in enumerate(self.layers) if not l.compressed]
        self.device = torch.device(device)
        self.codec = MessageCodec(quantize, index_coding, sign_rule)
        self.radix = Contract("radix", backend=settings.backend)
        # what it carries is a block of ``carried``, the FSDP state's: one transaction for every group
        self.carried, self.key = (carried if carried is not None else Carried(KINDS)), ("fsdp", name)
        self.wire = dense_wire(settings.dense_values, [self.layout.shards[j] for j in self.dense], comm.size,
                               comm.rank, self.device) if self.dense else None   # how the dense pieces travel
        self._sizes, self._dtypes = self._kinds()
        self.rsc = None
        if self.compressed:
            N, lay = comm.size, self.layout
            numels = [N * lay.shards[j] for j in self.compressed]
            self.rsc = SparseReduceScatter(comm, numels, f"fsdp.{name}", self.codec.value_dtype, self.codec.mean,
                                           regions=[Shards(n, N) for n in numels], index_coding=index_coding)
            starts = torch.tensor(self.rsc.offsets[:-1], dtype=torch.int64)
            self._bounds = torch.tensor(self.rsc.offsets[1:], dtype=torch.int64, device=self.device)
            self._shift = (torch.tensor([lay.offsets[j] - lay.rank * lay.shards[j] for j in self.compressed])
                           - starts).to(self.device)
        if self.compressed and self.dense:   # the dense parameters' columns in a row
            self._dense_out = torch.cat([torch.arange(self.layout.offsets[j], self.layout.offsets[j + 1])
                                         for j in self.dense]).to(self.device)

    @property
    def kind(self) -> str:
        return "sparse" if self.compressed else "dense"

    # -- state ------------------------------------------------------------------------------------
    def _kinds(self) -> tuple:
        """({kind: elements}, {kind: dtype}) of what this group carries: a compressed group's
        residual (and DGC velocity) of its whole buffer, in the storage dtype; an all-dense group's
        velocity of its row under momentum correction, in fp32."""
        s, lay = self.settings, self.layout
        if self.compressed:
            sizes = {"residual": lay.numel, **({"velocity": lay.numel} if s.momentum else {})}
        else:   # under int8 the codes' rounding waits in a residual
            sizes = {**({"residual": lay.numel} if self.wire.keeps_residual else {}),
                     **({"dense_velocity": lay.row} if s.momentum else {})}
        return sizes, {k: torch.float32 if k == "dense_velocity" else STORAGE[s.storage] for k in sizes}

    def _block(self) -> Block:
        """This group's block of the carried state, made on first use, marked written by this step."""
        blk = self.carried.block(self.key, self._sizes, self._dtypes, self.device)
        blk.written = True
        return blk

    @property
    def residual(self) -> Pair | None:
        """The residual's double buffer, None before the group's first step or load."""
        blk = self.carried.blocks.get(self.key)
        return None if blk is None else blk.pairs.get("residual")

    def buffers(self) -> dict:
        """The carried buffers by kind (current halves)."""
        blk = self.carried.blocks.get(self.key)
        return {} if blk is None else {kind: p.cur for kind, p in blk.pairs.items()}

    def load(self, held: dict) -> None:
        """Take saved buffers (``buffers()`` of the same group on the same world size)."""
        lay = self.layout
        sizes = {"residual": lay.numel, "velocity": lay.numel, "dense_velocity": lay.row}
        for key, t in held.items():
            if key not in sizes or t.numel() != sizes[key]:
                raise ValueError(f"FSDP group {self.name!r}: a saved {key} of {t.numel()} elements does not fit its "
                                 f"{sizes.get(key)} here: resume with the same model, FSDP wrapping and world size")
        pairs = self.carried.block(self.key, self._sizes, self._dtypes, self.device).pairs if self._sizes else {}
        for key, t in held.items():
            if key in pairs:   # a kind this group keeps under this config
                pairs[key].cur.copy_(t.reshape(-1))

    # -- the step ---------------------------------------------------------------------------------
    def reduce_scatter(self, out: torch.Tensor, grad: torch.Tensor, step: int, average: bool, factor: float,
                       decay: torch.Tensor | None = None, scratch=None) -> GroupStep:
        """``out`` (a row's size, FSDP's output) = this rank's row summed over ranks (divided by N
        with ``average``), from ``grad`` (the flat buffer, any float dtype). ``factor``: what the
        final gradient is the sum over ranks divided by (N for an average; FSDP's post-divide
        factor for a sum). ``decay``: weight decay w * wd of this rank's shard in the final
        gradient's units, or None (momentum correction: it joins the gradient before the
        velocity, here where this rank holds w: its own row, times ``factor``). ``scratch``: a
        callable giving fp32 buffers (bf16 storage)."""
        if not self.compressed:
            return self._dense(out, grad, average, factor, decay)
        lay, s = self.layout, self.settings
        grad = grad.reshape(-1)
        if decay is not None:
            grad = grad.float() if grad.dtype != torch.float32 else grad
            grad[lay.own()] += decay * factor
        acc = out if out.dtype == torch.float32 else torch.empty(lay.row, dtype=torch.float32, device=out.device)
        packed = self.wire.buffer(acc.device) if self.dense else None
        sels = self._rows(grad, step, packed, scratch)                # 1.-2. every other rank's row
        pending = self._send(sels)                                    # 3. to their owners
        self._own_row(acc, grad)                                      # 4. the own row, all of it
        dense = self._start_dense(packed)
        keys, sums = self.rsc.owner_sums(pending)                     # 3. what the others sent
        acc.index_add_(0, keys + self._shift[torch.searchsorted(self._bounds, keys, right=True)], sums)
        bad = torch.zeros((), dtype=torch.bool, device=acc.device)
        if s.check_finite:
            lo, hi = torch.aminmax(acc)
            bad = torch.stack([sel.nonfinite.any() for *_, sel in sels] +
                              [~(torch.isfinite(lo) & torch.isfinite(hi))] +
                              self._dense_checked(packed)).any()
        result = GroupStep(bad, pending.bytes["alltoall_sent"], pending.bytes["alltoall_received"],
                           (lay.size - 1) * lay.row * grad.element_size(), {"alltoall": pending.bytes["alltoall_sent"]})
        if dense is not None:                                         # 5. dense parameters
            self._finish_dense(acc, dense, result)
        if average:
            acc.div_(lay.size)
        if acc is not out:
            out.copy_(acc)
        return result

    def _pairs(self) -> tuple:
        pairs = self._block().pairs
        return pairs["residual"], pairs.get("velocity")

    def _rows(self, grad, step: int, packed, scratch) -> list:
        """1.-2. Row by row (the own row never goes through the selection): x = r + g (DGC:
        r + u), fused with the first histogram; exactly k per piece; x -= what the owner decodes,
        the velocity zeroed there; then the row's dense pieces go to ``packed`` (x = 0 there). x
        is the residual's spare half (fp32 storage), or one row of fp32 scratch rounded into it
        (bf16). Returns [(owner, its Segments, its int8 scales or None, its Selection)]."""
        s, lay = self.settings, self.layout
        r, u = self._pairs()
        fp32 = r.cur.dtype == torch.float32
        densities = [l.density if l.compressed else None for l in self.layers]
        sign, out = self.codec.sign(step), []
        for o, sl in lay.rows():
            if fp32:
                r_in, x = r.cur[sl], r.spare[sl]
                u_in, u_out = (u.cur[sl], u.spare[sl]) if u is not None else (None, None)
            else:   # accumulate in fp32, in place in one row of scratch
                r_in = x = scratch("x", lay.row).copy_(r.cur[sl])
                u_in = u_out = scratch("u", lay.row).copy_(u.cur[sl]) if u is not None else None
            seg = lay.segments(o, densities)
            extra = {} if u is None else {"velocity": u_in, "velocity_out": u_out, "momentum": s.momentum,
                                          "nesterov": s.nesterov}
            hist = compensate(r_in, grad[sl], x, first=HistogramRequest(seg, sign, self.radix), **extra)
            sel = select(seg, x, self.radix, sign=sign, mean=self.codec.mean, first=hist, update=True,
                         value_dtype=torch.float32 if self.codec.scaled else self.codec.value_dtype,
                         velocity=u_out if s.masking and u is not None else None)
            out.append((o, seg, *self._codes(x, seg, sel)))
            if packed is not None:   # 5. the dense parameters' pieces of this row leave x
                self._pack(x, packed[o])
            if not fp32:
                r.spare[sl] = x
                if u is not None:
                    u.spare[sl] = u_out
        return out

    def _codes(self, x: torch.Tensor, seg: Segments, sel) -> tuple:
        """(None, sel), or under int8 each piece's codes with one scale (``MessageCodec.to_wire``):
        (scales (L,) fp32, sel with the codes as its values). x gets back what the codes round
        off: the residual keeps it, as it keeps fp16's rounding."""
        if not self.codec.scaled:
            return None, sel
        codes, scales = [], []
        for j, (pos, val) in enumerate(zip(sel.parts(), sel.parts(sel.values))):
            code, scale = self.codec.to_wire(val)
            x.index_add_(0, pos.to(torch.int64) + seg.offsets[j], val - code.float() * scale)
            codes.append(code)
            scales.append(scale)
        return torch.cat(scales), replace(sel, values=torch.cat(codes))

    def _own_row(self, acc, grad) -> None:
        """4. The own row needs no wire and no selection: acc = r + g (DGC: u = m u + g, acc = r + u;
        the velocity is not masked, as for a dense layer); its residual becomes 0."""
        s, own = self.settings, self.layout.own()
        r, u = self._pairs()
        torch_compensate(r.cur[own], grad[own], acc, velocity_in=None if u is None else u.cur[own],
                         velocity_out=None if u is None else u.spare[own], momentum=s.momentum,
                         nesterov=s.nesterov, fma=False)
        r.spare[own] = 0.0

    def _send(self, sels: list) -> object:
        """3. The selected entries of every compressed parameter, in its pieces' coordinates
        (owner o's piece of parameter j starts at o * s_j), to their owners."""
        lay, positions, values, counts, scales = self.layout, [], [], [], []
        for j in self.compressed:
            pos, val = [], []
            for o, seg, _, sel in sels:
                a, b = seg.kofs[j], seg.kofs[j + 1]
                pos.append(sel.positions[a:b].to(torch.int64) + o * lay.shards[j])
                val.append(sel.values[a:b] if sel.values is not None else None)
            positions.append(torch.cat(pos))
            counts.append(positions[-1].numel())
            if self.codec.mean or self.codec.scaled:   # one mean or scale per owner; the own row's is never read
                per_owner = torch.zeros(lay.size, dtype=torch.float32, device=positions[-1].device)
                for o, _, scale, sel in sels:
                    per_owner[o] = sel.means[j] if self.codec.mean else scale[j]
                (values if self.codec.mean else scales).append(per_owner)
            if not self.codec.mean:
                values.append(torch.cat(val))
        return self.rsc.start(positions, values, counts, scales or None)

    # -- dense parameters ---------------------------------------------------------------------------
    def _pack(self, x: torch.Tensor, row: torch.Tensor) -> None:
        """5. A row's dense pieces into ``row`` of what travels; x keeps what stays (values: 0;
        int8 codes: their rounding)."""
        dense = x.index_select(0, self._dense_out)
        self.wire.pack(dense, row)
        x.index_copy_(0, self._dense_out, dense)

    def _dense_checked(self, packed: torch.Tensor | None) -> list:
        """The non-finite flag of what the dense wire carries where the output does not show it."""
        seen = None if packed is None else self.wire.checked(packed)
        return [] if seen is None else [~torch.isfinite(seen).all()]

    def _start_dense(self, packed: torch.Tensor | None):
        return None if packed is None else self.wire.start(self.comm, packed, name=f"fsdp.{self.name}.dense")

    def _finish_dense(self, out: torch.Tensor, handle, result: GroupStep) -> None:
        """5. The dense parameters' pieces of every other rank's row, summed by the dense wire."""
        out.index_add_(0, self._dense_out, self.wire.finish(self.comm, handle))
        result.sent += self.wire.sent
        result.received += self.wire.sent
        result.kinds["values"] = self.wire.sent

    def _dense(self, out: torch.Tensor, grad: torch.Tensor, average: bool, factor: float, decay) -> GroupStep:
        """A group whose parameters all go dense, by its dense wire: FSDP's own reduce-scatter of
        the gradient (fp32 or fp16), or int8 codes of r + g, r keeping their rounding; under momentum
        correction the weight decay joins the average and u = m u + avg on the shard (DGC's rule
        for dense layers: the average of the ranks' velocities is the velocity of the average),
        and the shard gets u (Nesterov: avg + m u)."""
        s, lay = self.settings, self.layout
        bad = torch.zeros((), dtype=torch.bool)
        if s.check_finite and grad.numel():
            lo, hi = torch.aminmax(grad)
            bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
        r = self._block().pairs["residual"] if self.wire.keeps_residual else None
        x = grad.reshape(-1) if r is None else r.cur.float() + grad.reshape(-1).float()
        share = self.wire.reduce(self.comm, x, out, average, name=f"fsdp.{self.name}")
        if r is not None:
            r.spare.copy_(x)
        if s.momentum:
            avg = out.float()
            if decay is not None:
                avg += decay if average else decay * factor
            u = self._block().pairs["dense_velocity"]
            out.copy_(corrected(avg, velocity(avg, u.cur, s.momentum, out=u.spare), s.momentum, s.nesterov))
        return GroupStep(bad, share, share, (lay.size - 1) * lay.row * grad.element_size(), {"values": share})
