"""Exactly k per layer on the CPU: the radix select's answer from a few native passes.

The radix select's result (``radix.py``) is fixed by each row's k-th largest key T and by
position order among the keys equal to T. Every element at or above T lies in any threshold
set {|x| > t} that holds at least k elements of the row's side, so the reference
(``radix_ref.py``) run on that set alone, in position order, gives the same T, positions,
values, means and side as on the whole layer. Per layer of a bucket:

    0. ``compensate``: x = r + g (DGC's momentum too) by the native kernel, layer by layer, which
       returns each sign's max and sum of x on the way: the candidates' first statistics pass;
    1. candidates: with ``hints`` (the caller's dict, kept from step to step), once a layer's
       k-th key has held steady, one index pass above the last one times ``HINT_MARGIN``, taken
       where it holds k to ``HINT_CAP`` k; else trimmed's threshold set
       (``searches.threshold_set``: a stats pass, a count pass of 7 thresholds, an index pass,
       over the native CPU passes) of |x|, or with a sign rule of each side's keys (the passes'
       ``side``: max(x, 0) or max(-x, 0), read from x itself), else the whole layer (small
       layers, NaN/Inf, fewer than k of a sign). Any set holding k keys of a side holds its top
       k and their ties, so the result does not depend on which set was found;
    2. a layer with candidates and k > 0: the k-th key, the count and sum above it, and the
       positions taken, by the native kernels over its candidates (``_native/exact_kernels.cpp``:
       the reference's T, need, float64 sum in position order and ties by position);
    3. the others (their whole layer) through the torch reference's levels, compaction and
       means, all at once;
    4. with ``update``, x -= what receivers decode (the reference's ``decode_add``).

The torch reference's full passes over a 16M-element bucket take seconds on a CPU; these take
a few passes over x. Registered as the ``native`` backend of ``radix`` (CPU float32).
"""
from __future__ import annotations

import math
import struct

import torch

from ..compensate import torch_compensate
from ..segments import Segments
from ..wire import to_wire
from . import native
from .contract import Contract
from .passes import Scan
from .radix_ref import TorchRadix, _ref_select, compensate_only, zero_padding
from .registry import Backend, Gate, register
from .searches import threshold_set

_EMPTY = torch.empty(0)
_WHOLE_BELOW = 1 << 16      # a layer this small goes to the reference whole: a pass over it is cheap
_TRIMMED = Contract.of("trimmed")
# A layer's k-th key moves little from one step to the next under error feedback, so a threshold a
# little below the last one usually holds k to a few k keys: one index pass instead of the
# search's count and index passes. Too few or too many and the search runs as without a hint.
HINT_MARGIN = 0.97
HINT_CAP = 8


class _NonFinite(ValueError):
    pass


def _stats_scan(finite: bool, mx: float, total: float) -> Scan:
    """What ``NativePasses.stats`` takes from a pass that already made it (no threshold; a NaN max,
    which marks a scan used, is stored as inf: the finite flag says it already)."""
    return Scan(math.nan, 0, None, None, 0, finite, mx if finite else math.inf, total)


def _sides(stats, R: int) -> tuple:
    """A layer's statistics from ``compensate`` ((finite, max, sum) of max(x, 0) and of max(-x, 0))
    as one stats scan per side selected from: |x|'s where R == 1, else (positive, negative)."""
    if stats is None:
        return (None, None)
    finite, mp, sp, mn, sn = stats
    if R == 1:
        return (_stats_scan(finite, max(mp, mn), sp + sn),)
    return (_stats_scan(finite, mp, sp), _stats_scan(finite, mn, sn))


def _hint(hints: dict | None, key: tuple) -> float | None:
    """The threshold to try first: HINT_MARGIN times the last k-th key, once it has held steady
    (moved by less than 1 - HINT_MARGIN over the step before). While it grows, as a residual's does
    over its first steps, a hint would miss and cost a pass."""
    got = None if hints is None else hints.get(key)
    return HINT_MARGIN * got[0] if got is not None and got[1] else None


def _remember(hints: dict, key: tuple, t: float) -> None:
    last = hints.get(key)
    hints[key] = (t, last is not None and abs(t - last[0]) <= (1.0 - HINT_MARGIN) * last[0])


def _from_hint(mod, v: torch.Tensor, k: int, side: int, t: float | None) -> torch.Tensor | None:
    """Ascending positions of key > t where they are k to HINT_CAP k of them and x is finite, else None."""
    if t is None:
        return None
    idx, _, count, finite = mod.select_above(v, t, HINT_CAP * k, True, False, side)
    return idx if finite and k <= count <= HINT_CAP * k else None


def _candidates(mod, v: torch.Tensor, k: int, R: int, active: tuple, first=None, hints: dict | None = None,
                key: tuple = ()) -> torch.Tensor | None:
    """Ascending positions of a threshold set holding at least k of each side selected from (of
    |x| where R == 1; per side, of that side's keys, the other side's being 0), or None: the
    layer goes to the reference whole. first: the layer's statistics from ``compensate``;
    hints, key: where side s's last k-th key is kept (``hints[key + (s,)]``), or None."""
    n = v.numel()
    if n < _WHOLE_BELOW or 8 * k > n:
        return None
    try:
        if k == 0:   # the finite check a whole layer makes (else the first stats pass makes it)
            native.NativePasses(mod, v, _NonFinite()).stats()
            return torch.empty(0, dtype=torch.int64)
        sets, scans = [], _sides(first, R)
        for s in active:     # a side's own set: what the error feedback left there can be far from half
            side = 0 if R == 1 else (1, -1)[s]
            got = _from_hint(mod, v, k, side, _hint(hints, key + (s,)))
            if got is None:
                be = native.NativePasses(mod, v, _NonFinite(), scans[s], side=side)
                found = threshold_set(v, k, be, _TRIMMED)
                if found is None:
                    return None
                got = found[0]
            sets.append(got)
    except _NonFinite:
        return None
    return sets[0] if len(sets) == 1 else torch.unique(torch.cat(sets))


class NativeRadix:
    """The ``native`` radix backend: ``compensate`` and ``select`` (``decode_add``: the reference's)."""

    @staticmethod
    def compensate(seg: Segments, out, R: int, residual, grad, velocity=None, velocity_out=None,
                   momentum: float = 0.0, nesterov: bool = False):
        """out = residual + grad (DGC's momentum too), as the reference computes it. Returns, per
        layer, the statistics its candidates' search starts from (None: a small layer, made by the
        reference's torch ops), or None where the native kernel cannot take these tensors or no
        layer is large enough to search (one torch op over the bucket then, not one per layer)."""
        mod = native.load()
        if grad.dtype != torch.float32 or mod is None or max(seg.sizes, default=0) < _WHOLE_BELOW:
            compensate_only(seg, out, residual, grad, velocity, velocity_out, momentum, nesterov)
            return None
        mom = velocity is not None
        views = zip(*(seg.views(t) for t in (residual, grad, out) + ((velocity, velocity_out) if mom else ())))
        stats = []
        for r, g, o, *u in views:
            if o.numel() < _WHOLE_BELOW:   # torch ops cost less than a call here
                torch_compensate(r, g, o, velocity_in=u[0] if mom else None, velocity_out=u[1] if mom else None,
                                 momentum=momentum, nesterov=nesterov, fma=False)
                stats.append(None)
                continue
            stats.append(mod.compensate_sides(r, g, o, *(u if mom else (_EMPTY, _EMPTY)), float(momentum),
                                              bool(nesterov)))
        zero_padding(seg, out, velocity_out)
        return stats

    takes_hints = True   # radix.select hands it the caller's dict of last k-th keys

    @staticmethod
    def select(seg, x, R, active, k_row, hist, index_dtype, value_dtype, mean, update, velocity, hints=None):
        mod = native.load()
        views = seg.views(x)
        firsts = hist if isinstance(hist, list) else [None] * len(views)
        cands = [_candidates(mod, v, k, R, active, f, hints, (v.numel(), i))                         # 1.
                 for i, (v, k, f) in enumerate(zip(views, seg.ks, firsts))]
        fast = {i for i, (c, k) in enumerate(zip(cands, seg.ks)) if c is not None and k > 0}
        rest = [i for i in range(len(views)) if i not in fast]
        if not fast:   # every layer through the reference at once: its result as it comes            3.
            pos, vals, means, bad, kth, side = _reference(seg, views, cands, rest, R, active, k_row, mean)
        else:
            signed = mean or len(active) == 2   # the reference makes a mean for these only
            rows = {}
            for i in sorted(fast):                                                                  # 2.
                rows[i], keys = _exact_over(mod, views[i], cands[i], seg.ks[i], R, active, signed)
                if hints is not None:
                    for s, t in keys.items():
                        _remember(hints, (views[i].numel(), i, s), t)
            if rest:                                                                                # 3.
                got = _reference(seg, views, cands, rest, R, active, k_row, mean)
                ks = [seg.ks[i] for i in rest]
                per = [got[0].split(ks), got[1].split(ks)] + \
                    [[None] * len(rest) if t is None else t.split(1) for t in got[2:]]
                rows.update({i: tuple(f[j] for f in per) for j, i in enumerate(rest)})
            pos, vals, means, bad, kth, side = (_cat([rows[i][f] for i in range(len(views))]) for f in range(6))
        pos, vals = pos.to(index_dtype), to_wire(vals, value_dtype)
        if update and seg.k_total:                                                                 # 4.
            TorchRadix.decode_add(seg, x, pos[None], None if mean else vals[None],
                                  means.float()[None] if mean else None, -1.0, velocity)
        return pos, vals, means, bad, kth, side


def _cat(parts: list):
    return None if any(p is None for p in parts) else torch.cat(parts)


def _exact_over(mod, v: torch.Tensor, cand: torch.Tensor, k: int, R: int, active: tuple, signed: bool) -> tuple:
    """One layer's (positions, float32 values, signed mean, non-finite, k-th key, side), each a
    tensor, from its candidates by the native kernels, as the reference gives them
    (``_native/exact_kernels.cpp``); the mean is None where the reference makes none."""
    xs = v.index_select(0, cand)
    sides = [-1] if R == 1 else list(active)
    stats = {s: mod.kth_side(xs, k, s) for s in sides}           # s: (T, need, mean magnitude)
    s = (1 if stats[1][2] > stats[0][2] else 0) if len(active) == 2 else sides[0]
    t, need, mag = stats[s]
    took = mod.take_side(xs, k, s, t, need)
    m = torch.tensor([-mag if s == 1 else mag], dtype=torch.float64).float() if signed else None
    # each side's k-th key as a float (its bits are T's), by the side index ``_candidates`` loops over
    keys = {(active[0] if side == -1 else side): struct.unpack("<f", struct.pack("<I", got[0]))[0]
            for side, got in stats.items()}
    return (cand.index_select(0, took), xs.index_select(0, took), m, torch.zeros(1, dtype=torch.bool),
            torch.tensor([t], dtype=torch.int32), torch.tensor([max(s, 0)], dtype=torch.int8)), keys


def _reference(seg, views, cands, rows: list, R, active, k_row, mean) -> tuple:
    """The torch reference over these layers' candidates (the whole layer where None) at once:
    (positions in their layers, float32 values, means, non-finite, k-th key, side). No host read:
    the exchange's radix path makes none."""
    cs = [torch.arange(views[i].numel()) if cands[i] is None else cands[i] for i in rows]
    sub = Segments([c.numel() for c in cs], [seg.ks[i] for i in rows])
    xs = torch.cat([views[i].index_select(0, c) for i, c in zip(rows, cs)])
    k_sub = k_row.view(len(seg), R)[torch.tensor(rows)].reshape(-1) if len(rows) < len(seg) else k_row
    pos, vals, means, bad, kth, side = _ref_select(sub, xs, R, active, k_sub, None, torch.int64, torch.float32,
                                                   mean, False, None)
    pos = torch.cat([c.index_select(0, p) for c, p in zip(cs, pos.split(sub.ks))])
    return pos, vals, means, bad, kth, side


register(Backend("native", ("radix",), Gate(native.load, NativeRadix), devices=("cpu",), dtypes=(torch.float32,),
                 rank=2, unit="bucket"))
