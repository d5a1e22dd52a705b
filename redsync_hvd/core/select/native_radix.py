"""Exactly k per layer on the CPU: the radix select's answer from a few native passes.

The radix select's result (``radix.py``) is fixed by each row's k-th largest key T and by
position order among the keys equal to T. Every element at or above T lies in any threshold
set {|x| > t} that holds at least k elements of the row's side, so the reference
(``radix_ref.py``) run on that set alone, in position order, gives the same T, positions,
values, means and side as on the whole layer. Per layer of a bucket:

    1. candidates: trimmed's threshold set (``searches.threshold_set``: a stats pass, a count
       pass of 7 thresholds, an index pass, over the native CPU passes) of |x|, or with a sign
       rule of each side's keys (x clamped to the side), else the whole layer (small layers,
       NaN/Inf, fewer than k of a sign);
    2. the torch reference's levels, compaction and means over the candidates of every layer
       at once, their positions mapped back to the layer's;
    3. with ``update``, x -= what receivers decode (the reference's ``decode_add``).

The torch reference's full passes over a 16M-element bucket take seconds on a CPU; these take
a few passes over x. Registered as the ``native`` backend of ``radix`` (CPU float32).
"""
from __future__ import annotations

import threading

import torch

from ..segments import Segments
from . import native
from .contract import Contract
from .radix_ref import TorchRadix, _ref_select, compensate_only
from .registry import Backend, Gate, register
from .searches import threshold_set

_WHOLE_BELOW = 1 << 16      # a layer this small goes to the reference whole: a pass over it is cheap
_TRIMMED = Contract.of("trimmed")


class _NonFinite(ValueError):
    pass


_LOCAL = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """A buffer of n floats kept per thread: a fresh one of a large layer's size each step would be
    page-faulted in anew (glibc maps allocations over 32 MB afresh)."""
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _LOCAL.buf = torch.empty(n)
    return buf[:n]


def _candidates(mod, v: torch.Tensor, k: int, R: int, active: tuple) -> torch.Tensor | None:
    """Ascending positions of a threshold set holding at least k of each side selected from (of
    |x| where R == 1; per side, of that side's keys, the other side's being 0), or None: the
    layer goes to the reference whole."""
    n = v.numel()
    if n < _WHOLE_BELOW or 8 * k > n:
        return None
    try:
        if k == 0 or R == 2:   # the finite check a whole layer makes (R == 1: threshold_set's stats make it)
            native.NativePasses(mod, v, _NonFinite()).stats()
        if k == 0:
            return torch.empty(0, dtype=torch.int64)
        if R == 1:
            got = threshold_set(v, k, native.NativePasses(mod, v, _NonFinite()), _TRIMMED)
            return None if got is None else got[0]
        sets = []
        for s in active:     # a side's keys: what the error feedback left there can be far from half
            keys = _scratch(n)   # the passes rank |x|: x clamped to the side is the side's key
            torch.clamp(v, max=0.0, out=keys) if s else torch.clamp(v, min=0.0, out=keys)
            got = threshold_set(keys, k, native.NativePasses(mod, keys, _NonFinite()), _TRIMMED)
            if got is None:
                return None
            sets.append(got[0])
    except _NonFinite:
        return None
    return sets[0] if len(sets) == 1 else torch.unique(torch.cat(sets))


class NativeRadix:
    """The ``native`` radix backend: ``compensate`` and ``select`` (``decode_add``: the reference's)."""

    @staticmethod
    def compensate(seg: Segments, out, R: int, residual, grad, velocity=None, velocity_out=None,
                   momentum: float = 0.0, nesterov: bool = False):
        """out = residual + grad (DGC's momentum too), as the reference computes it; no histogram:
        ``select`` finds its candidates from passes of its own."""
        compensate_only(seg, out, residual, grad, velocity, velocity_out, momentum, nesterov)
        return None

    @staticmethod
    def select(seg, x, R, active, k_row, hist, index_dtype, value_dtype, mean, update, velocity):
        mod = native.load()
        views = seg.views(x)
        cands = [_candidates(mod, v, k, R, active) for v, k in zip(views, seg.ks)]                # 1.
        cands = [torch.arange(v.numel()) if c is None else c for v, c in zip(views, cands)]
        sub = Segments([c.numel() for c in cands], seg.ks)
        xs = torch.cat([v.index_select(0, c) for v, c in zip(views, cands)])
        pos, vals, means, bad, kth, side = _ref_select(sub, xs, R, active, k_row, None, torch.int64,   # 2.
                                                       value_dtype, mean, False, None)
        pos = torch.cat([c.index_select(0, p) for c, p in zip(cands, pos.split(seg.ks))]).to(index_dtype)
        if update and seg.k_total:                                                                 # 3.
            TorchRadix.decode_add(seg, x, pos[None], None if mean else vals[None],
                                  means.float()[None] if mean else None, -1.0, velocity)
        return pos, vals, means, bad, kth, side


register(Backend("native", ("radix",), Gate(native.load, NativeRadix), devices=("cpu",), dtypes=(torch.float32,),
                 rank=2, unit="bucket"))
