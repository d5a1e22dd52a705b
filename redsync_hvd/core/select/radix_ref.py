"""The torch reference of the radix select (``radix.py``): the kernels' steps in plain torch ops.

:class:`TorchRadix` is the ``torch`` backend of the ``radix`` strategy (any device) and the
reference the Triton kernels (``triton_select.py``) are tested against bit for bit. A radix
backend offers its three methods: ``compensate`` (x = r + g, DGC's momentum too, and the first
histogram), ``select`` (the levels, the compaction, the means, the update) and ``decode_add``.
"""
from __future__ import annotations

import torch

from ..compensate import torch_compensate
from ..segments import BINS, NONFINITE_BIN, SHIFTS, Segments, to_device
from ..wire import to_wire
from .reference import kth_bin

ABS = 0x7FFFFFFF


class TorchRadix:
    """The radix select's steps in torch ops (see the module docstring)."""

    @staticmethod
    def compensate(seg: Segments, out, R: int, residual, grad, velocity=None, velocity_out=None,
                   momentum: float = 0.0, nesterov: bool = False) -> torch.Tensor:
        """out = residual + grad (DGC: velocity_out = grad + momentum * velocity, out = residual +
        velocity_out, or residual + grad + momentum * velocity_out); the first histogram of out."""
        compensate_only(seg, out, residual, grad, velocity, velocity_out, momentum, nesterov)
        key, neg = _keys(_real(seg, out))
        return _histogram(0, key, neg, seg.compact().seg_of(out.device), R, None, len(seg))

    @staticmethod
    def select(seg, x, R, active, k_row, hist, index_dtype, value_dtype, mean, update, velocity):
        return _ref_select(seg, x, R, active, k_row, hist, index_dtype, value_dtype, mean, update, velocity)

    @staticmethod
    def decode_add(seg: Segments, out, pos, vals, mns, alpha: float, zero) -> None:
        """out[offsets[i] + p] += alpha * v for every rank's message, in rank order."""
        tab = seg.tables(out.device)
        base = tab.offsets.index_select(0, tab.slot_seg)
        for r in range(pos.shape[0]):   # rank order: the same sum on every rank
            p = pos[r].long() + base
            v = vals[r].float() if vals is not None else mns[r].index_select(0, tab.slot_seg)
            out.index_add_(0, p, v * alpha)
            if zero is not None:
                zero.index_fill_(0, p, 0.0)


def compensate_only(seg: Segments, out, residual, grad, velocity, velocity_out, momentum: float,
                    nesterov: bool) -> None:
    """``TorchRadix.compensate`` without its histogram: out (and velocity_out), zeros in the padding."""
    # the kernels' order of operations, unfused (torch.add's alpha may use an FMA)
    torch_compensate(residual, grad, out, velocity_in=velocity, velocity_out=velocity_out, momentum=momentum,
                     nesterov=nesterov, fma=False)
    zero_padding(seg, out, velocity_out)


def zero_padding(seg: Segments, *flats) -> None:
    """Zeros between the layers of each flat buffer given (None skipped), as the kernels write."""
    if seg.padded:
        for t in flats:
            if t is not None:
                t.index_fill_(0, _padding(seg, t.device), 0.0)


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
    b, above = kth_bin(h, need)
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
        if K:
            TorchRadix.decode_add(layout, flat, pos[None], None if mean else vals[None],
                                  means.float()[None] if mean else None, -1.0, velocity)
    return pos, vals, means, bad, t_row.to(torch.int32), side.to(torch.int8)


def _magnitude(key, neg, seg_of, R, s, T, need, ks):
    """Row s's mean key over its k (float64): the keys above T, plus need copies of T."""
    key_s = key if R == 1 else torch.where(neg == s, key, 0)
    above = key_s > T.index_select(0, seg_of)
    vals = torch.where(above, key_s.view(torch.float32).double(), 0.0)
    sums = torch.zeros(T.numel(), dtype=torch.float64, device=key.device).index_add_(0, seg_of, vals)
    at_t = torch.where(need > 0, need * T.to(torch.int32).view(torch.float32).double(), 0.0)
    return (sums + at_t) / ks.double().clamp(min=1)
