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

**Regions: a fixed permutation, then equal ranges.** Position p of an n-element layer belongs
to owner ``floor(((a * p) mod n) * N / n)``, with a near n times the golden ratio's fraction and
coprime with n (Fibonacci hashing, as ZEN hashes positions: Wang et al., OSDI 2025). The map
p -> (a * p) mod n is a bijection, so every region has ceil(n/N) or floor(n/N) positions, and it
scatters what clusters (a row of an FC layer, a band of an embedding) over all owners, where
ranges of positions would send a cluster to one owner. It depends on n and N only: no state,
nothing to rebalance or checkpoint, and every rank computes the same regions.

**Error feedback stays exact.** Nothing any rank selected vanishes:
  * an entry this rank sent whose position the owner did not keep goes back into this rank's
    residual. The rank sees it without a message: after the allgather it knows every owner's
    kept positions, and it knows what it sent (``Result.carry``);
  * with fp16 values the owner rounds each kept sum to fp16 (clamped to the finite range) and
    keeps the rounding error in its own residual, also in ``Result.carry``.
So after every step, (sum over steps of N * the applied average) + (every rank's residual)
equals the sum of every rank's gradients, to float rounding.

Sign-mean messages (RedSync's default) travel as positions plus one mean per layer in step 2
(or one mean per layer and owner, where each owner's positions were selected apart); the owners'
sums are no longer one value, so step 5 sends fp32 values.

Each rank's messages differ in size per owner, so step 2 carries a small header per owner
(the count of every layer); step 5 has the same size on every rank (c per layer, padded with
zero values at position 0 when a region summed fewer entries), so it needs none.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..core.segments import Segments
from ..core.select import Contract, select

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_ALIGN = 8
_FP16_MAX = 65504.0
TOPK = Contract("exact", finite=False)   # the owners' sums as torch.topk ranks them (NaN passes on)


@dataclass(frozen=True)
class Regions:
    """The owners of one n-element layer's positions among ``size`` ranks."""
    numel: int
    size: int
    multiplier: int

    @classmethod
    def of(cls, numel: int, size: int) -> "Regions":
        a = max(1, round(numel * _GOLDEN))
        while math.gcd(a, numel) != 1:
            a += 1
        return cls(numel, size, a % max(numel, 1))

    def owners(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 owner of every position (int64, in [0, numel))."""
        q = positions.to(torch.int64) * self.multiplier % self.numel
        return q * self.size // self.numel

    def sizes(self) -> list:
        """Positions each owner holds: ceil((o+1) n / N) - ceil(o n / N)."""
        n, N = self.numel, self.size
        return [-(-(o + 1) * n // N) + (-o * n // N) for o in range(N)]


@dataclass(frozen=True)
class Shards:
    """The owners of one layer cut into ``size`` contiguous shards of ceil(n/size) positions
    (FSDP's dim-0 sharding of a padded parameter: rank o updates positions [o*s, (o+1)*s))."""
    numel: int
    size: int

    @property
    def shard(self) -> int:
        return max(1, -(-self.numel // self.size))

    def owners(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 owner of every position (int64, in [0, numel))."""
        return positions.to(torch.int64) // self.shard

    def sizes(self) -> list:
        """Positions each owner holds (the last shards may be short or empty)."""
        return [max(0, min(self.shard, self.numel - o * self.shard)) for o in range(self.size)]


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
    rows: torch.Tensor = None   # every owner's piece, (N, bytes)
    bytes: dict = field(default_factory=dict)


def allgather(comm, pendings: list, name: str):
    """Step 5 for several buckets in one collective round: their owners' pieces back to back
    (every rank's row has the same layout); ``wait_allgather`` cuts them per bucket."""
    return comm.allgather_async(torch.cat([p.chunk for p in pendings]), name=name)


def wait_allgather(comm, handle, pendings: list) -> None:
    rows, at = comm.wait(handle).view(comm.size, -1), 0
    for p in pendings:
        p.rows = rows[:, at:at + p.chunk.numel()]
        at += p.chunk.numel()


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _pad(nbytes: int) -> int:
    return -nbytes % _ALIGN


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
                 regions: list | None = None):
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
        self.wire_dtype = torch.float16 if value_dtype == torch.float16 else torch.float32

    def keep(self, ks: list) -> list:
        """Entries each owner keeps per layer: ceil(k/N) (every position at density 1)."""
        return [-(-k // self.size) for k in ks]

    # -- 1./2. each rank's entries to their owners ---------------------------------------------
    def start(self, positions: list, values: list, ks: list) -> _Pending:
        """positions: per layer, int (this layer's own positions); values: per layer, one per
        position, or with sign_mean one mean (1,) or one mean per owner (size,); ks: this step's
        k per layer (the same on every rank)."""
        L = len(self.numels)
        pos, lid, own, vals = [], [], [], []
        for l, (p, v) in enumerate(zip(positions, values)):
            p = p.reshape(-1).to(torch.int64)
            pos.append(p)
            lid.append(torch.full_like(p, l))
            own.append(self.regions[l].owners(p))
            v = v.reshape(-1).float()
            if self.sign_mean:   # each position's value is its owner's mean (or the layer's one)
                v = v[own[-1]] if v.numel() == self.size and self.size > 1 else v.expand(p.numel())
            vals.append(v)
        pos, lid, own, vals = (torch.cat(t) for t in (pos, lid, own, vals))
        flat = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=pos.device)[lid] + pos
        total = self.offsets[-1]
        pending = _Pending(list(ks), (own * total + flat, flat, vals))
        order = torch.argsort(own * L + lid, stable=True)
        counts = torch.bincount(own * L + lid, minlength=self.size * L).view(self.size, L).to(torch.int32)
        means = self._means(values) if self.sign_mean else None
        payload, splits = self._pack(counts, pos[order].to(torch.int32),
                                     None if self.sign_mean else vals[order].to(self.value_dtype), means)
        mine = splits[self.comm.rank]
        pending.bytes = {"alltoall_sent": sum(splits) - mine}
        pending.handle = self.comm.alltoall_async(payload, splits, name=f"{self.name}.a2a")
        return pending

    def _means(self, values: list) -> torch.Tensor:
        """(size, L) fp32: the mean each owner gets per layer (one per layer repeated for every owner)."""
        rows = []
        for v in values:
            v = v.reshape(-1).float()
            rows.append(v if v.numel() == self.size and self.size > 1 else
                        (v[:1] if v.numel() else v.new_zeros(1)).expand(self.size))
        return torch.stack(rows, 1)

    def _pack(self, counts, pos, vals, means) -> tuple:
        """One uint8 payload, per owner: [counts (L,) int32 | positions int32 | values or means],
        padded to 8 bytes; and the bytes each owner gets."""
        parts, splits, at = [], [], 0
        per_owner = counts.sum(1).tolist()
        for o, n in enumerate(per_owner):
            chunk = [_raw(counts[o]), _raw(pos[at:at + n]), _raw(means[o] if vals is None else vals[at:at + n])]
            nbytes = sum(c.numel() for c in chunk)
            chunk.append(torch.zeros(_pad(nbytes), dtype=torch.uint8, device=pos.device))
            parts += chunk
            splits.append(nbytes + _pad(nbytes))
            at += n
        return torch.cat(parts), splits

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
        kept_pos, kept_val = self._select(keys, sums, self.keep(pending.ks))
        wire = kept_val.clamp(-_FP16_MAX, _FP16_MAX).to(self.wire_dtype) if self.wire_dtype == torch.float16 \
            else kept_val
        if self.wire_dtype == torch.float16:   # the rounding error stays with the owner (exact feedback)
            kept_flat = kept_pos + torch.tensor(self.offsets[:-1], device=kept_pos.device).repeat_interleave(
                torch.tensor(self.keep(pending.ks), device=kept_pos.device))
            pending.carry = (kept_flat, kept_val - wire.float())
        chunk = torch.cat([_raw(kept_pos.to(torch.int32)), _raw(wire)])
        chunk = torch.cat([chunk, chunk.new_zeros(_pad(chunk.numel()))])
        pending.bytes["allgather_sent"] = chunk.numel() if self.size > 1 else 0
        pending.bytes["allgather_received"] = (self.size - 1) * chunk.numel()
        pending.chunk = chunk

    def _unpack(self, payload: torch.Tensor, splits: list) -> tuple:
        """Every sender's entries for this owner: (flat positions int64, fp32 values)."""
        L, starts = len(self.numels), [0]
        for s in splits:
            starts.append(starts[-1] + s)
        heads = [payload[a:a + 4 * L].view(torch.int32) for a, s in zip(starts, splits)]
        counts = torch.stack(heads).tolist() if heads else []
        offsets = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=payload.device)
        vsize = torch.empty(0, dtype=self.value_dtype).element_size()
        flat, vals = [], []
        for a, c in zip(starts, counts):
            n, at = sum(c), a + 4 * L
            lid = torch.repeat_interleave(torch.arange(L, device=payload.device),
                                          torch.tensor(c, device=payload.device))
            flat.append(payload[at:at + 4 * n].view(torch.int32).to(torch.int64) + offsets[lid])
            at += 4 * n
            if self.sign_mean:
                vals.append(payload[at:at + 4 * L].view(torch.float32)[lid])
            else:
                vals.append(payload[at:at + vsize * n].view(self.value_dtype).float())
        return torch.cat(flat), torch.cat(vals)

    def _sum(self, flat: torch.Tensor, vals: torch.Tensor) -> tuple:
        """The sparse sum: sorted distinct flat positions and the sum of their values."""
        keys, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        sums = torch.zeros(keys.numel(), dtype=torch.float32, device=flat.device).index_add_(0, inverse, vals)
        return keys, sums

    def _select(self, keys: torch.Tensor, sums: torch.Tensor, keep: list) -> tuple:
        """Per layer, the ``keep`` largest |sum| (its own positions, fp32 sums), padded with
        (position 0, value 0) to exactly ``keep``: every owner's message has the same size."""
        bounds = torch.searchsorted(keys, torch.tensor(self.offsets, device=keys.device)).tolist()
        sizes = [b - a for a, b in zip(bounds, bounds[1:])]
        seg = Segments(sizes, [min(c, n) for c, n in zip(keep, sizes)])
        top = select(seg, sums, TOPK)
        pos, val = [], []
        for l, (c, idx, seg_keys, seg_sums) in enumerate(zip(keep, top.parts(), seg.views(keys), seg.views(sums))):
            short = c - idx.numel()
            pos += [seg_keys[idx] - self.offsets[l], seg_keys.new_zeros(short)]
            val += [seg_sums[idx], seg_sums.new_zeros(short)]
        return torch.cat(pos), torch.cat(val)

    def finish(self, pending: _Pending, out: torch.Tensor | None = None) -> Result:
        """The applied averages, and what goes back into this rank's residual, from every owner's
        piece (``pending.rows``, set by ``allgather``). ``out``: a zeroed fp32 buffer of the
        bucket's size to decode into (the averages are its views)."""
        rows = pending.rows
        keep = self.keep(pending.ks)
        C = sum(keep)
        kept_pos = rows[:, :4 * C].contiguous().view(torch.int32).to(torch.int64)
        vsize = torch.empty(0, dtype=self.wire_dtype).element_size()
        kept_val = rows[:, 4 * C:4 * C + vsize * C].contiguous().view(self.wire_dtype).float()
        starts = torch.tensor(self.offsets[:-1], device=rows.device).repeat_interleave(
            torch.tensor(keep, device=rows.device))
        flat = kept_pos + starts                                                     # (N, C)
        total = self.offsets[-1]
        if out is None:
            out = torch.zeros(total, dtype=torch.float32, device=rows.device)
        # one owner per position: each output gets a single term, so dividing the kept values
        # equals dividing the sum, without a pass over the whole buffer
        out.index_add_(0, flat.reshape(-1), kept_val.reshape(-1).to(out.device) / self.size)
        owner = torch.arange(self.size, device=rows.device)[:, None]
        applied = torch.sort((owner * total + flat).reshape(-1)).values
        keys, my_flat, my_vals = pending.sent
        at = torch.searchsorted(applied, keys).clamp_(max=max(applied.numel() - 1, 0))
        back = applied[at] != keys if applied.numel() else torch.ones_like(keys, dtype=torch.bool)
        carry_flat, carry_val = my_flat[back], my_vals[back]
        if pending.carry is not None:
            carry_flat = torch.cat([carry_flat, pending.carry[0]])
            carry_val = torch.cat([carry_val, pending.carry[1]])
        return Result(list(out.split(self.numels)), self._per_layer(carry_flat, carry_val), pending.bytes)

    def _per_layer(self, flat: torch.Tensor, vals: torch.Tensor) -> list:
        lid = torch.searchsorted(torch.tensor(self.offsets[1:], device=flat.device), flat, right=True)
        return [(flat[lid == l] - self.offsets[l], vals[lid == l]) for l in range(len(self.numels))]
