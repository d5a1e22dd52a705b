"""A sparse reduce-scatter for one bucket of (position, value) messages (Ok-Topk: Li and Hoefler,
PPoPP 2022), so that the bytes a worker receives stay flat in N instead of growing as an
allgather's (N-1) * k.

    1. regions   every layer's positions are split into N regions, one per rank (its owner)
    2. alltoall  each rank sends its selected entries of region o to rank o
    3. sum       each owner adds the entries it received (a sparse sum over its region)
    4. select    each owner keeps the c = ceil(k/N) largest summed magnitudes of every layer
    5. allgather every owner's c (position, value) pairs per layer: every rank applies the
                 same sparse update, the sum over owners divided by N

**Owners: a given map, or hashed regions.** ``regions`` maps every layer's positions to their
owners; by default each layer's are hashed into N regions (below). FSDP's sharded training gives
them instead: a rank owns the contiguous shard of every parameter that its optimizer updates
(:class:`Shards`, used by ``exchange/sharded.py``, which takes steps 1-3 and hands the owner's
sums to FSDP: there every owner keeps all it received, so steps 4-5 do not run).

**Regions** (``regions.py``): a fixed permutation of each layer's positions, then equal ranges.

**Error feedback stays exact.** Nothing any rank selected vanishes:
  * an entry this rank sent whose position the owner did not keep goes back into this rank's
    residual. The rank sees it without a message: after the allgather it knows every owner's
    kept positions, and it knows what it sent (``Result.carry``);
  * with fp16 or int8 values the owner rounds each kept sum (fp16: clamped to the finite range;
    int8: a code of one scale per layer) and keeps the rounding error in its own residual, also
    in ``Result.carry``. A sender's own int8 rounding stayed in its residual before it sent.
So after every step, (sum over steps of N * the applied average) + (every rank's residual)
equals the sum of every rank's gradients, to float rounding.

Sign-mean messages (RedSync's default) travel as positions plus one mean per layer in step 2
(or one mean per layer and owner, where each owner's positions were selected apart); the owners'
sums are no longer one value, so step 5 sends fp32 values.

Each rank's messages differ in size per owner, so step 2 carries a small header per owner
(the count of every layer). With int32 positions and fp32 or fp16 values step 5 has the same
size on every rank (c per layer, padded with zero values at position 0 when a region summed
fewer entries), so it needs none.

**Coded entries** (``scatter_wire.py``). Under ``message.index_coding: golomb`` each owner's share
of a layer travels as the Golomb-Rice code of its places in the owner's region, and under
``message.quantize: int8`` as int8 codes with one scale per layer and sender (step 2) or owner
(step 5); an owner decodes before it sums, every rank before it applies. Step 5's pieces then
differ in size, so each rank's row of the allgather starts with their sizes. At density 0.1
an entry takes about 2 bytes instead of 6 (int32 and fp16).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.segments import Segments
from ..core.select import Contract, select
from ..core.wire import to_wire
from .regions import Regions
from .scatter_wire import ChunkFormat, padding, raw_bytes

TOPK = Contract("exact", finite=False)   # the owners' sums as torch.topk ranks them (NaN passes on)


@dataclass
class Result:
    """What a bucket's reduce-scatter gives this rank.

    averages: per layer, the applied update (sum over owners / N), fp32, views of one flat buffer.
    carry: per layer, (positions int64, values fp32) to add to this rank's residual: what it sent
        and no owner kept, and (as an owner) the fp16 rounding error of what it kept.
    bytes: what this rank put into and took out of the two collectives, self excluded."""
    averages: list
    carry: list
    bytes: dict = field(default_factory=dict)


@dataclass
class _Pending:
    ks: list
    sent: tuple                 # (owner-qualified flat keys, flat positions, fp32 values) of this rank
    handle: object = None       # the alltoall
    carry: tuple = None         # the owner's rounding error: (flat positions, fp32 values)
    chunk: torch.Tensor = None  # this owner's piece of step 5 (uint8, the same size on every rank)
    rows: torch.Tensor = None   # every owner's piece, (N, bytes), or N pieces of their own sizes (coded)
    fixed: bool = True          # the piece has the same size on every rank (raw positions, fp32 or fp16)
    bytes: dict = field(default_factory=dict)


def allgather(comm, pendings: list, name: str):
    """Step 5 for several buckets in one collective round: their owners' pieces back to back.
    Fixed-size pieces have the same layout on every rank; where some piece is coded (its size
    differs per owner), each rank's row starts with the sizes of its pieces (int32, padded to 8)."""
    if all(p.fixed for p in pendings):
        return comm.allgather_async(torch.cat([p.chunk for p in pendings]), name=name)
    head = torch.tensor([p.chunk.numel() for p in pendings], dtype=torch.int32, device=pendings[0].chunk.device)
    head = raw_bytes(head)
    head = torch.cat([head, head.new_zeros(padding(head.numel()))])
    if comm.size > 1:
        pendings[0].bytes["allgather_sent"] += head.numel()
    return comm.allgather_async(torch.cat([head] + [p.chunk for p in pendings]), name=name)


def wait_allgather(comm, handle, pendings: list) -> None:
    """Hands each bucket every owner's piece: ``rows`` (N, bytes), or a list of N with coded pieces."""
    if all(p.fixed for p in pendings):
        rows, at = comm.wait(handle).view(comm.size, -1), 0
        for p in pendings:
            p.rows = rows[:, at:at + p.chunk.numel()]
            at += p.chunk.numel()
        return
    gathered, at, B = comm.wait(handle), 0, len(pendings)
    for p in pendings:
        p.rows = []
    for _ in range(comm.size):
        sizes = gathered[at:at + 4 * B].view(torch.int32).tolist()
        at += 4 * B + padding(4 * B)
        for p, size in zip(pendings, sizes):
            p.rows.append(gathered[at:at + size])
            at += size
    for p in pendings:
        p.bytes["allgather_received"] = sum(row.numel() for r, row in enumerate(p.rows) if r != comm.rank)
        p.rows = torch.stack(p.rows) if p.fixed else p.rows


class SparseReduceScatter:
    """One bucket's sparse reduce-scatter over ``comm`` (alltoall_async, allgather_async, wait).

    numels: the bucket's layers' sizes, in the bucket's order (the same on every rank).
    value_dtype: of the values that travel (fp32, or fp16: step 5 then also sends fp16).
    sign_mean: step 2 sends one mean per layer (or per layer and owner) instead of a value per
    position. regions: each layer's owners (``Regions``, ``Shards``; default: hashed ``Regions``).

    ``start`` (from the send step) starts the alltoall; ``reduce`` (in finish, once per bucket, in
    bucket order on every rank) waits for it, sums and selects; the module's ``allgather`` sends
    the pieces of every bucket reduced so far in one collective (one round, however many
    buckets), ``wait_allgather`` hands each bucket its rows, and ``finish`` decodes."""

    def __init__(self, comm, numels: list, name: str, value_dtype=torch.float32, sign_mean: bool = False,
                 regions: list | None = None, index_coding: str = "raw"):
        if sum(numels) >= 2**31:
            raise ValueError(f"{name}: a bucket of {sum(numels)} elements is past int32 positions; lower "
                             "compression.fusion_bytes, or use aggregation: allgather")
        self.comm, self.name, self.size = comm, name, comm.size
        self.numels = list(numels)
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.regions = list(regions) if regions is not None else [Regions.of(n, self.size) for n in self.numels]
        if len(self.regions) != len(self.numels) or any(r.numel != n or r.size != self.size
                                                         for r, n in zip(self.regions, self.numels)):
            raise ValueError(f"{name}: regions must map each of the {len(self.numels)} layers' positions to "
                             f"{self.size} owners (one per layer, of its size)")
        self.value_dtype, self.sign_mean = value_dtype, sign_mean
        self.wire_dtype = value_dtype if value_dtype in (torch.float16, torch.int8) else torch.float32
        golomb = index_coding == "golomb"
        self.sent_format = ChunkFormat(tuple(self.numels), value_dtype, golomb, sign_mean)
        self.kept_format = ChunkFormat(tuple(self.numels), self.wire_dtype, golomb)
        self.coded = golomb or self.wire_dtype == torch.int8   # step 5 then sends counts and codes

    def keep(self, ks: list) -> list:
        """Entries each owner keeps per layer: ceil(k/N) (every position at density 1)."""
        return [-(-k // self.size) for k in ks]

    # -- 1./2. each rank's entries to their owners ---------------------------------------------
    def start(self, positions: list, values: list, ks: list, scales: list | None = None) -> _Pending:
        """positions: per layer, int (this layer's own positions; sorted with Golomb coding); values:
        per layer, one per position (int8 codes with int8), or with sign_mean one mean (1,) or one
        mean per owner (size,); ks: this step's k per layer (the same on every rank); scales: with
        int8, per layer the fp32 scale a code is worth, (1,) or one per owner (size,)."""
        L = len(self.numels)
        pos, lid, own, vals, wire, places = [], [], [], [], [], []
        for l, (p, v) in enumerate(zip(positions, values)):
            p = p.reshape(-1).to(torch.int64)
            pos.append(p)
            lid.append(torch.full_like(p, l))
            own.append(self.regions[l].owners(p))
            places.append(self.regions[l].local(p) if self.sent_format.golomb else p)
            v = v.reshape(-1)
            if self.sign_mean:   # each position's value is its owner's mean (or the layer's one)
                v = self._per_position(v, own[-1]).expand(p.numel())
            wire.append(v)
            vals.append(v.float() * self._per_position(scales[l], own[-1]) if scales is not None else v.float())
        pos, lid, own, vals, wire, places = (torch.cat(t) for t in (pos, lid, own, vals, wire, places))
        flat = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=pos.device)[lid] + pos
        keys = own * self.offsets[-1] + flat
        pending = _Pending(list(ks), (keys, flat, vals))
        if self.sent_format.golomb:   # coded in order of their place in the owner's region
            order = torch.argsort((own * L + lid) * (max(self.numels) + 1) + places)
        else:
            order = torch.argsort(own * L + lid, stable=True)
        counts = torch.bincount(own * L + lid, minlength=self.size * L).view(self.size, L)
        per_layer = self._per_owner(values if self.sign_mean else scales) \
            if self.sign_mean or scales is not None else None
        values_out = None if self.sign_mean else wire[order].to(self.value_dtype)
        payload, splits = self._pack(counts, places[order], values_out, per_layer)
        mine = splits[self.comm.rank]
        pending.bytes = {"alltoall_sent": sum(splits) - mine}
        pending.handle = self.comm.alltoall_async(payload, splits, name=f"{self.name}.a2a")
        return pending

    def _per_position(self, per_layer: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
        """A layer's scale (or mean) for each of its positions: its one, or its owner's."""
        t = per_layer.reshape(-1).float()
        return t[owners] if t.numel() == self.size and self.size > 1 else t

    def _per_owner(self, per_layer: list) -> torch.Tensor:
        """(size, L) fp32: the mean or scale each owner gets per layer (one per layer repeated for
        every owner, or one per layer and owner)."""
        rows = []
        for v in per_layer:
            v = v.reshape(-1).float()
            rows.append(v if v.numel() == self.size and self.size > 1 else
                        (v[:1] if v.numel() else v.new_zeros(1)).expand(self.size))
        return torch.stack(rows, 1)

    def _pack(self, counts, pos, vals, per_layer) -> tuple:
        """One uint8 payload of every owner's chunk (``scatter_wire.py``), and its bytes per owner."""
        chunks, at = [], 0
        for o, row in enumerate(counts.tolist()):
            n = sum(row)
            chunks.append(self.sent_format.pack(row, pos[at:at + n], None if vals is None else vals[at:at + n],
                                                None if per_layer is None else per_layer[o], self._ranges(o)))
            at += n
        return torch.cat(chunks), [c.numel() for c in chunks]

    # -- 3./4./5. the owner's sum and selection, then the allgather ----------------------------
    def owner_sums(self, pending: _Pending) -> tuple:
        """Steps 2-3 on the owner's side: wait for the alltoall and add up what every rank sent
        this owner: (sorted distinct flat positions int64, their fp32 sums)."""
        payload, splits = self.comm.wait(pending.handle)
        flat, vals = self._unpack(payload, splits)
        pending.bytes["alltoall_received"] = sum(splits) - splits[self.comm.rank]
        return self._sum(flat, vals)

    def reduce(self, pending: _Pending) -> None:
        """Wait for the alltoall; sum, keep and encode this owner's piece (``pending.chunk``), which
        ``allgather`` sends, for this bucket alone or with other buckets' in one collective."""
        keys, sums = self.owner_sums(pending)
        kept = self._select(keys, sums, self.keep(pending.ks))
        if self.coded:
            return self._encode_kept(pending, kept)
        kept_pos = torch.cat([t for l in kept for t in (l[0], l[0].new_zeros(l[2]))])
        kept_val = torch.cat([t for l in kept for t in (l[1], l[1].new_zeros(l[2]))])
        wire = to_wire(kept_val, self.wire_dtype)
        if self.wire_dtype == torch.float16:   # the rounding error stays with the owner (exact feedback)
            kept_flat = kept_pos + torch.tensor(self.offsets[:-1], device=kept_pos.device).repeat_interleave(
                torch.tensor(self.keep(pending.ks), device=kept_pos.device))
            pending.carry = (kept_flat, kept_val - wire.float())
        chunk = torch.cat([raw_bytes(kept_pos.to(torch.int32)), raw_bytes(wire)])
        chunk = torch.cat([chunk, chunk.new_zeros(padding(chunk.numel()))])
        self._sent(pending, chunk)

    def _encode_kept(self, pending: _Pending, kept: list) -> None:
        """Step 5's piece with coded positions or int8 values (``scatter_wire.py``): what each layer
        kept and no padding, sorted by position for Golomb; the owner keeps what int8 or fp16 rounds off."""
        positions = torch.cat([p for p, _, _ in kept])
        if self.kept_format.golomb:   # coded in order of their place in this owner's region
            places = [r.local(p) for r, (p, _, _) in zip(self.regions, kept)]
            order = [torch.argsort(q) for q in places]
            kept = [(p[o], v[o], 0) for (p, v, _), o in zip(kept, order)]
            positions = torch.cat([q[o] for q, o in zip(places, order)])
        wire, scales, worth = self.kept_format.quantize([v for _, v, _ in kept])
        if self.wire_dtype != torch.float32:
            starts = torch.tensor(self.offsets[:-1], device=positions.device)
            flat = torch.cat([p + starts[l] for l, (p, _, _) in enumerate(kept)])
            pending.carry = (flat, torch.cat([v for _, v, _ in kept]) - worth)
        self._sent(pending, self.kept_format.pack([p.numel() for p, _, _ in kept], positions, wire, scales,
                                                  self._ranges(self.comm.rank)))
        pending.fixed = False

    def _sent(self, pending: _Pending, chunk: torch.Tensor) -> None:
        pending.bytes["allgather_sent"] = chunk.numel() if self.size > 1 else 0
        pending.bytes["allgather_received"] = (self.size - 1) * chunk.numel()
        pending.chunk = chunk

    def _unpack(self, payload: torch.Tensor, splits: list) -> tuple:
        """Every sender's entries for this owner: (flat positions int64, fp32 values)."""
        offsets = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=payload.device)
        flat, vals, at = [], [], 0
        for size in splits:
            lid, pos, v = self.sent_format.unpack(payload[at:at + size], self._ranges(self.comm.rank))
            if self.sent_format.golomb:
                pos = self._positions(lid, pos, self.comm.rank)
            flat.append(offsets[lid] + pos)
            vals.append(v)
            at += size
        return torch.cat(flat), torch.cat(vals)

    def _sum(self, flat: torch.Tensor, vals: torch.Tensor) -> tuple:
        """The sparse sum: sorted distinct flat positions and the sum of their values."""
        keys, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        sums = torch.zeros(keys.numel(), dtype=torch.float32, device=flat.device).index_add_(0, inverse, vals)
        return keys, sums

    def _select(self, keys: torch.Tensor, sums: torch.Tensor, keep: list) -> list:
        """Per layer, the ``keep`` largest |sum|: (its own positions, their fp32 sums, how many
        short of ``keep`` it is, where the region summed fewer entries)."""
        bounds = torch.searchsorted(keys, torch.tensor(self.offsets, device=keys.device)).tolist()
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        seg = Segments(sizes, [min(c, n) for c, n in zip(keep, sizes)])
        top = select(seg, sums, TOPK)
        return [(seg_keys[idx] - self.offsets[l], seg_sums[idx], c - idx.numel())
                for l, (c, idx, seg_keys, seg_sums) in enumerate(zip(keep, top.parts(), seg.views(keys),
                                                                   seg.views(sums)))]

    def finish(self, pending: _Pending, out: torch.Tensor | None = None) -> Result:
        """The applied averages, and what goes back into this rank's residual, from every owner's
        piece (``pending.rows``, set by ``allgather``). ``out``: a zeroed fp32 buffer of the
        bucket's size to decode into (the averages are its views)."""
        flat, kept_val, owner = self._kept(pending) if pending.fixed else self._decode_kept(pending)
        total = self.offsets[-1]
        if out is None:
            out = torch.zeros(total, dtype=torch.float32, device=flat.device)
        # one owner per position: each output gets a single term, so dividing the kept values
        # equals dividing the sum, without a pass over the whole buffer
        out.index_add_(0, flat.reshape(-1), kept_val.reshape(-1).to(out.device) / self.size)
        applied = torch.sort((owner * total + flat).reshape(-1)).values
        keys, my_flat, my_vals = pending.sent
        at = torch.searchsorted(applied, keys).clamp_(max=max(applied.numel() - 1, 0))
        back = applied[at] != keys if applied.numel() else torch.ones_like(keys, dtype=torch.bool)
        carry_flat, carry_val = my_flat[back], my_vals[back]
        if pending.carry is not None:
            carry_flat = torch.cat([carry_flat, pending.carry[0]])
            carry_val = torch.cat([carry_val, pending.carry[1]])
        return Result(list(out.split(self.numels)), self._per_layer(carry_flat, carry_val), pending.bytes)

    def _kept(self, pending: _Pending) -> tuple:
        """Every owner's kept entries from fixed-size pieces: (flat positions, fp32 values, owner), (N, C) each."""
        rows, keep = pending.rows, self.keep(pending.ks)
        C = sum(keep)
        kept_pos = rows[:, :4 * C].contiguous().view(torch.int32).to(torch.int64)
        vsize = torch.empty(0, dtype=self.wire_dtype).element_size()
        kept_val = rows[:, 4 * C:4 * C + vsize * C].contiguous().view(self.wire_dtype).float()
        starts = torch.tensor(self.offsets[:-1], device=rows.device).repeat_interleave(
            torch.tensor(keep, device=rows.device))
        return kept_pos + starts, kept_val, torch.arange(self.size, device=rows.device)[:, None]

    def _decode_kept(self, pending: _Pending) -> tuple:
        """The same from coded pieces (one per owner, of its own size): flat, one entry after another."""
        starts = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=pending.rows[0].device)
        parts = [self.kept_format.unpack(row, self._ranges(o)) for o, row in enumerate(pending.rows)]
        if self.kept_format.golomb:
            parts = [(lid, self._positions(lid, pos, o), v) for o, (lid, pos, v) in enumerate(parts)]
        flat = torch.cat([starts[lid] + pos for lid, pos, _ in parts])
        owner = torch.cat([torch.full_like(pos, o) for o, (_, pos, _) in enumerate(parts)])
        return flat, torch.cat([v for _, _, v in parts]), owner

    def _ranges(self, owner: int) -> list:
        """How many places each layer's region of ``owner`` has (what its coded positions index)."""
        return [r.sizes()[owner] for r in self.regions]

    def _positions(self, lid: torch.Tensor, places: torch.Tensor, owner: int) -> torch.Tensor:
        """Each layer's own positions of ``owner``'s places in its regions."""
        out = torch.empty_like(places)
        for l, region in enumerate(self.regions):
            mask = lid == l
            out[mask] = region.position(places[mask], owner)
        return out

    def _per_layer(self, flat: torch.Tensor, vals: torch.Tensor) -> list:
        lid = torch.searchsorted(torch.tensor(self.offsets[1:], device=flat.device), flat, right=True)
        return [(flat[lid == l] - self.offsets[l], vals[lid == l]) for l in range(len(self.numels))]
