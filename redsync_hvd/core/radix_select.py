"""Exactly k per layer of a bucket, chosen on the device by a radix select: no host wait.

RedSync's threshold binary search (Fang et al., 2019) probes one threshold per pass and
reads each count back to the host. Here each pass tests every threshold of a digit at once
(a histogram), the interval is narrowed on the device, and the result has exactly k
positions, so message sizes are known on the host before the step (the shape of AIR top-k,
Zhang et al., SC'23). For every layer (``Segments``: one flat fp32 buffer, one k per layer):

    key  = float32 bits of |x| (sign=None), or of x on its kept side (below): a non-negative
           float orders like its bit pattern; NaN/Inf sit at the top (bits >= 0x7F800000)
    need = k, prefix = 0
    for (shift, bins) in (23, 256), (11, 4096), (0, 2048):    # 8 + 12 + 11 = 31 bits
        h    = histogram of (key >> shift) & (bins-1) over keys whose higher bits == prefix
        b    = largest bin with sum(h[b:]) >= need             # on the device
        need = need - sum(h[b+1:]);  prefix |= b << shift
    T    = prefix                                              # the k-th largest key, exactly
    take = key > T, and the first `need` keys == T in position order   (exactly k, ties by position)
    out  = positions of take, ascending; values x there; or one mean of x there (sign_mean)

Sign-restricted selection ("pos"/"neg": RedSync's alternating sign_mean) ranks key =
x on the kept side and 0 elsewhere, so it returns the k largest of that sign (topped up
with the first elements of key 0 if the layer has fewer than k of them); "larger" (SBC,
Sattler et al., 2019) selects both sides and keeps, per layer, the side whose mean over its
k is larger in magnitude. The first histogram splits by sign, so all four modes share it.

Stages, each one launch for the whole bucket (``triton_select.py``), or the same steps in
plain torch ops that run on any device (here, the reference the kernels are tested against):

    hist = compensate(seg, r, g, out, ...)   # out = r + g (DGC momentum too) + histogram 1
    sel  = select(seg, out, hist=hist, update=True, ...)   # levels 2-3, compaction, means: Selection,
                                             # and out[sent] -= what receivers decode
    decode_add(seg, avg, pos, vals, ...)     # gathered messages of N ranks, in rank order
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from redsync_hvd.core.segments import BINS, NONFINITE_BIN, SHIFTS, Segments, to_device
from redsync_hvd.core.wire import to_wire

ABS = 0x7FFFFFFF
SIGNS = (None, "pos", "neg", "larger")
BACKENDS = ("auto", "torch", "triton")
_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Selection:
    """Exactly ``seg.ks[i]`` positions per layer i, in ``[seg.kofs[i], seg.kofs[i+1])``.

    positions: (K,) layer-local, ascending within each layer (index_dtype).
    values: (K,) x at those positions in ``value_dtype`` (the wire's), or None with ``mean``.
    means: (L,) float32 with ``mean``: the kept side's mean magnitude, signed (+ positive
    side, - negative side), else None. nonfinite: (L,) bool, the layer holds NaN or Inf (its
    result is still well formed). kth: (L,) int32, bits of the k-th largest key of the kept
    side (``kth.view(torch.float32)``). side: (L,) int8, 0 = positive side kept, 1 = negative
    (sign given), else None.
    """
    positions: torch.Tensor
    values: torch.Tensor | None
    means: torch.Tensor | None
    nonfinite: torch.Tensor
    kth: torch.Tensor
    side: torch.Tensor | None


def sides(sign: str | None) -> tuple[int, tuple[int, ...]]:
    """(rows per layer R, the rows selected from): sign=None ranks |x| in one row; a sign
    splits each layer into a positive row 0 and a negative row 1."""
    if sign not in SIGNS:
        raise ValueError(f"sign={sign!r} is not one of {SIGNS}")
    return {None: (1, (0,)), "pos": (2, (0,)), "neg": (2, (1,)), "larger": (2, (0, 1))}[sign]


def k_rows(seg: Segments, device, sign: str | None) -> torch.Tensor:
    """(L*R,) int32: k for every (layer, row) selected from, 0 for a row not selected from."""
    R, active = sides(sign)
    return seg.derived(f"k_rows:{sign}", device, lambda: to_device(torch.tensor(
        [k if r in active else 0 for k in seg.ks for r in range(R)], dtype=torch.int32), device))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels(backend: str, t: torch.Tensor):
    """The Triton module for this call, or None for the torch reference."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and not t.is_cuda):
        return None
    try:
        from redsync_hvd.core import triton_select
    except ImportError as e:
        if backend == "auto":
            return None
        raise ValueError(f"backend='triton' unavailable: {e}. Install it: pip install triton==3.9.0") from e
    if not t.is_cuda and not _interpreting():
        raise ValueError("backend='triton' on a CPU tensor runs only in Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before triton is imported, or pass CUDA tensors")
    return triton_select


def _check(name: str, t: torch.Tensor | None, numel: int, dtypes=(torch.float32,)) -> None:
    if t is None:
        return
    if t.dim() != 1 or t.numel() != numel or t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{name}: need a contiguous 1-D tensor of {numel} elements of dtype "
                         f"{'/'.join(str(d) for d in dtypes)}, got {tuple(t.shape)} {t.dtype}")


def compensate(seg: Segments, residual: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, *,
               velocity: torch.Tensor | None = None, velocity_out: torch.Tensor | None = None,
               momentum: float = 0.0, nesterov: bool = False, sign: str | None = None,
               backend: str = "auto") -> torch.Tensor:
    """out = residual + grad, fused with the first histogram of out (pass it to ``select``).

    With ``velocity`` (DGC momentum correction): velocity_out = grad + momentum * velocity,
    out = residual + velocity_out, or residual + (grad + momentum * velocity_out) with
    ``nesterov``. grad may be fp16/bf16; everything else is fp32. ``out`` may be
    ``residual`` and ``velocity_out`` may be ``velocity`` (in place). Returns the
    (L*R, 256) int32 histogram of the exponents for ``sign``'s rows.
    """
    R, _ = sides(sign)
    for name, t, dt in (("residual", residual, (torch.float32,)), ("grad", grad, _GRAD_DTYPES),
                        ("out", out, (torch.float32,)), ("velocity", velocity, (torch.float32,)),
                        ("velocity_out", velocity_out, (torch.float32,))):
        _check(name, t, seg.n, dt)
    if (velocity is None) != (velocity_out is None):
        raise ValueError("compensate: pass velocity and velocity_out together (or neither)")
    ks = _kernels(backend, out)
    if ks is not None:
        return ks.pass1(seg, out, R, residual=residual, grad=grad, velocity=velocity,
                        velocity_out=velocity_out, momentum=float(momentum), nesterov=nesterov)
    g = grad.float()
    if velocity is None:
        torch.add(residual, g, out=out)
    else:   # the kernels' order of operations, unfused (torch.add's alpha may use an FMA)
        torch.add(g, velocity * momentum, out=velocity_out)
        torch.add(residual, g + velocity_out * momentum if nesterov else velocity_out, out=out)
    if seg.padded:   # the kernels write zeros between layers
        for t in (out, velocity_out):
            if t is not None:
                t.index_fill_(0, _padding(seg, out.device), 0.0)
    key, neg = _keys(_real(seg, out))
    return _histogram(0, key, neg, seg.compact().seg_of(out.device), R, None, len(seg))


def select(seg: Segments, x: torch.Tensor, *, sign: str | None = None, mean: bool = False,
           hist: torch.Tensor | None = None, index_dtype: torch.dtype = torch.int32,
           value_dtype: torch.dtype = torch.float32, update: bool = False,
           velocity: torch.Tensor | None = None, backend: str = "auto") -> Selection:
    """Exactly ``seg.ks[i]`` elements of each layer of the flat float32 ``x`` (the order is in
    the module docstring). No host wait; output sizes come from ``seg``; NaN/Inf set
    ``nonfinite`` and raise nothing.

    sign: None (rank |x|), "pos"/"neg" (the k largest of that sign), "larger" (per layer the
    side with the larger mean magnitude over its k). mean: one value per layer instead of the
    values (RedSync's sign_mean; needs a sign). hist: the first histogram, from ``compensate``
    with the same sign. value_dtype: the values as they travel (float32/float16/bfloat16).
    update: subtract from x what receivers will decode (the values as sent, or the mean), in
    the same pass (error feedback); velocity: also zero it at the positions (DGC's masking).
    """
    R, active = sides(sign)
    _check("x", x, seg.n)
    _check("velocity", velocity, seg.n)
    if mean and sign is None:
        raise ValueError("select: mean=True (sign_mean) needs sign='pos', 'neg' or 'larger'")
    if index_dtype not in (torch.int32, torch.int64) or value_dtype not in _GRAD_DTYPES:
        raise ValueError(f"select: index_dtype={index_dtype} must be int32/int64 and value_dtype="
                         f"{value_dtype} one of {_GRAD_DTYPES}")
    if velocity is not None and not update:
        raise ValueError("select: velocity masking comes with update=True")
    if hist is not None and (tuple(hist.shape) != (len(seg) * R, BINS[0]) or hist.dtype != torch.int32):
        raise ValueError(f"hist: need the ({len(seg) * R}, {BINS[0]}) int32 histogram that compensate() "
                         f"returns for sign={sign!r}, got {tuple(hist.shape)} {hist.dtype}")
    ks = _kernels(backend, x)
    run = _ref_select if ks is None else ks.select
    pos, vals, means, bad, kth, side = run(seg, x, R, active, k_rows(seg, x.device, sign), hist,
                                           index_dtype, value_dtype, mean, update, velocity)
    return Selection(pos, None if mean else vals, means if mean else None, bad, kth,
                     None if sign is None else side)


def decode_add(seg: Segments, out: torch.Tensor, positions: torch.Tensor,
               values: torch.Tensor | None = None, *, means: torch.Tensor | None = None,
               alpha: float = 1.0, zero: torch.Tensor | None = None, backend: str = "auto") -> None:
    """out[offsets[i] + p] += alpha * v for every message, in rank order (deterministic).

    positions: (N, K) or (K,) layer-local (int32/int64), each layer's ascending, as ``select``
    returns them; values: the same shape, any float dtype (the wire's), or ``means``: (N, L)
    or (L,), one value per layer. ``zero``: a float32 buffer set to 0 at every decoded position
    (DGC's momentum masking of the velocity)."""
    _check("out", out, seg.n)
    _check("zero", zero, seg.n)
    if seg.k_total == 0:
        return
    pos = positions.reshape(-1, seg.k_total)
    if positions.dim() not in (1, 2) or positions.shape[-1] != seg.k_total \
            or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: need (N, {seg.k_total}) or ({seg.k_total},) int32/int64, "
                         f"got {tuple(positions.shape)} {positions.dtype}")
    if (values is None) == (means is None):
        raise ValueError("decode_add: pass exactly one of values (per position) and means (per layer)")
    if values is not None and values.reshape(-1).numel() != pos.numel():
        raise ValueError(f"values: need the shape of positions {tuple(positions.shape)}, got {tuple(values.shape)}")
    if means is not None and means.reshape(-1).numel() != pos.shape[0] * len(seg):
        raise ValueError(f"means: need ({pos.shape[0]}, {len(seg)}), one per rank and layer, got {tuple(means.shape)}")
    vals = None if values is None else values.reshape(pos.shape).contiguous()
    mns = None if means is None else means.reshape(pos.shape[0], len(seg)).float().contiguous()
    ks = _kernels(backend, out)
    if ks is not None:
        return ks.decode_add(seg, out, pos.contiguous(), vals, mns, float(alpha), zero)
    tab = seg.tables(out.device)
    base = tab.offsets.index_select(0, tab.slot_seg)
    for r in range(pos.shape[0]):   # rank order: the same sum on every rank
        p = pos[r].long() + base
        v = vals[r].float() if vals is not None else mns[r].index_select(0, tab.slot_seg)
        out.index_add_(0, p, v * alpha)
        if zero is not None:
            zero.index_fill_(0, p, 0.0)


# ---- the torch reference: the kernels' steps in plain torch ops (any device) ----------------

def _real(seg: Segments, flat: torch.Tensor) -> torch.Tensor:
    """The layers' elements of a flat buffer, back to back (the buffer itself without padding)."""
    return flat.index_select(0, seg.real(flat.device)) if seg.padded else flat


def _padding(seg: Segments, device) -> torch.Tensor:
    """The flat indices of the padding between layers."""
    def build():
        ends = [o + s for o, s in zip(seg.offsets, seg.sizes)]
        pad = [i for end, start in zip(ends, seg.offsets[1:]) for i in range(end, start)]
        return to_device(torch.tensor(pad, dtype=torch.int64), device)
    return seg.derived("padding", device, build)


def _keys(x: torch.Tensor):
    bits = x.view(torch.int32)
    return bits & ABS, (bits < 0).long()


def _histogram(level, key, neg, seg_of, R, prefix, L):
    """Histogram of digit ``level`` of the keys whose higher digits match their row's prefix."""
    B, shift = BINS[level], SHIFTS[level]
    row = seg_of * R + neg if R == 2 else seg_of
    idx = row * B + ((key >> shift) & (B - 1))
    if level:
        ps = SHIFTS[level - 1]
        match = (key >> ps) == (prefix.index_select(0, row) >> ps)
        idx = torch.where(match, idx, L * R * B)        # the others go to a spare bin
    hist = torch.zeros(L * R * B + 1, dtype=torch.int32, device=key.device)
    hist.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
    return hist[:-1].view(L * R, B)


def _choose(level, hist, prefix, need, zeros, R):
    """Per row: the bin holding the need-th largest key; returns the new (prefix, need).
    Sided rows count the other side's elements as key 0 while their prefix is 0."""
    h = hist.to(torch.int64, copy=True)
    if R == 2:
        h[:, 0] += torch.where(prefix == 0, zeros, 0)
    c = h.flip(1).cumsum(1).flip(1)                     # c[b] = keys in bins >= b
    b = ((c >= need[:, None]).sum(1) - 1).clamp_(min=0)
    above = (c.gather(1, b[:, None]) - h.gather(1, b[:, None])).squeeze(1)
    return prefix | (b << SHIFTS[level]), need - above


def _seg_exclusive_cumsum(flag, start):
    c = flag.long().cumsum(0) - flag.long()
    return c - c.index_select(0, start)


def _ref_select(seg, x, R, active, k_row, hist, index_dtype, value_dtype, mean, update, velocity):
    """1. histogram 1 (unless given), non-finite flags, other-side counts; 2. three levels of
    choose / refine: T, need per row; 3. per selected row the sum of its keys above T, the
    mean magnitude over its k, the side (SBC: the larger); 4. compaction of the kept row;
    5. with update: x -= what was sent there."""
    L, K, dev, layout, flat = len(seg), seg.k_total, x.device, seg, x
    x, seg = _real(seg, x), seg.compact()      # padding is never selected: leave it out
    tab, seg_of = seg.tables(dev), seg.seg_of(dev)
    key, neg = _keys(x)
    h = _histogram(0, key, neg, seg_of, R, None, L) if hist is None else hist
    bad = h[:, NONFINITE_BIN:].sum(1).view(L, R).sum(1) > 0
    zeros = h.sum(1, dtype=torch.int64).view(L, R).flip(1).reshape(-1) if R == 2 else None
    T, need = torch.zeros(L * R, dtype=torch.int64, device=dev), k_row.long()
    for level in range(3):
        if level:
            h = _histogram(level, key, neg, seg_of, R, T, L)
        T, need = _choose(level, h, T, need, zeros, R)
    T, need = T.view(L, R), need.view(L, R)
    side = torch.full((L,), active[0], dtype=torch.int64, device=dev)
    means = None
    if mean or len(active) == 2:
        mag = {s: _magnitude(key, neg, seg_of, R, s, T[:, s], need[:, s], tab.ks) for s in active}
        if len(active) == 2:
            side = (mag[1] > mag[0]).long()
            means = torch.where(side == 1, -mag[1], mag[0]).float()
        else:
            means = (-mag[1] if active[0] else mag[0]).float()
    t_row, n_row = T.gather(1, side[:, None])[:, 0], need.gather(1, side[:, None])[:, 0]
    elem_side = side.index_select(0, seg_of)
    key_s = key if R == 1 else torch.where(neg == elem_side, key, 0)
    t, nd = t_row.index_select(0, seg_of), n_row.index_select(0, seg_of)
    start = tab.offsets.index_select(0, seg_of)
    eq = key_s == t
    take = (key_s > t) | (eq & (_seg_exclusive_cumsum(eq, start) < nd))
    dst = torch.where(take, tab.kofs.index_select(0, seg_of) + _seg_exclusive_cumsum(take, start), K)
    pos = torch.empty(K + 1, dtype=index_dtype, device=dev)
    pos.scatter_(0, dst, (torch.arange(seg.n, device=dev) - start).to(index_dtype))   # others: spare slot
    vals = to_wire(torch.empty(K + 1, dtype=torch.float32, device=dev).scatter_(0, dst, x)[:K], value_dtype)
    pos = pos[:K]
    if update:   # what receivers decode: the mean, or the values as they travel
        sent = {"means": means} if mean else {"values": vals}
        decode_add(layout, flat, pos, alpha=-1.0, zero=velocity, backend="torch", **sent)
    return pos, vals, means, bad, t_row.to(torch.int32), side.to(torch.int8)


def _magnitude(key, neg, seg_of, R, s, T, need, ks):
    """Row s's mean key over its k (float64): the keys above T, plus need copies of T."""
    key_s = key if R == 1 else torch.where(neg == s, key, 0)
    above = key_s > T.index_select(0, seg_of)
    vals = torch.where(above, key_s.view(torch.float32).double(), 0.0)
    sums = torch.zeros(T.numel(), dtype=torch.float64, device=key.device).index_add_(0, seg_of, vals)
    at_t = torch.where(need > 0, need * T.to(torch.int32).view(torch.float32).double(), 0.0)
    return (sums + at_t) / ks.double().clamp(min=1)
