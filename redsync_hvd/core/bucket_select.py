"""Selecting from every layer of a bucket at once: the GPU path of RedSync's selection.

On a GPU a layer's passes cost microseconds; what costs is each host wait, and a wait
inside a gradient hook also stalls the CPU that should be queueing the rest of the
backward pass. Selecting layer by layer (``select_topk``) waits two to four times per
layer. Here every decision is made on the device, layer by layer but without reading
anything back, and the host waits once per bucket, for all the layers' counts:

    bits = float32 bit patterns of |x|      # non-negative floats order like their bits
    h1   = histogram of bits >> 19          # 4096 bins, one pass
    b1   = the bin holding the k-th largest |x|
    h2   = histogram of (bits >> 7) & 4095 over the elements in bin b1
    thr  = (b1 << 19) | (b2 << 7)           # the k-th largest |x|, rounded down to 128 ulps
    keep = bits >= thr (and the kept sign, for sign_mean)
    -- one host wait: every layer's count --
    idx  = nonzero_static(keep, size=count)  # no wait: the size is known

A layer sends k to k + (ties within 128 ulps) elements, capped at 2k (the ``tbs``
contract). Non-finite values sit in the top bins (bits >= 0x7F800000), so the same
histogram reports them at no extra pass. The same torch ops run on the CPU, where the
tests check them; there the per-layer native passes are several times faster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .wire import widen

_BINS = 4096
_SHIFT1, _SHIFT2 = 19, 7       # 12 bits each of a non-negative float32's 31
_NONFINITE_BIN = 0x7F800000 >> _SHIFT1


@dataclass
class BucketSelection:
    indices: List[torch.Tensor]            # per layer: int64 positions within the layer, ascending
    values: List[torch.Tensor]             # per layer: x at those positions, or (1,) mean (sign_mean)
    selected: List[int]                    # per layer: |x| >= threshold, before the sign filter
    nonfinite: List[bool]                  # per layer: holds NaN/Inf (then nothing is selected)


def _kth_bin(hist: torch.Tensor, k):
    """The bin holding the k-th largest element, and how many lie above that bin (0-dim tensors)."""
    at_or_above = hist.flip(0).cumsum(0).flip(0)            # elements in bins >= b
    b = ((at_or_above >= k).sum() - 1).clamp_(min=0)
    # index_select, not [b + 1]: indexing by a tensor would read b back to the host
    above = torch.cat([at_or_above, at_or_above.new_zeros(1)]).index_select(0, (b + 1).reshape(1))[0]
    return b, above


def _threshold(bits: torch.Tensor, k: int):
    """(threshold bits, non-finite flag) for one layer, both on the device."""
    hi = bits >> _SHIFT1
    h1 = torch.bincount(hi, minlength=_BINS)
    bad = h1[_NONFINITE_BIN:].sum() > 0
    b1, above = _kth_bin(h1, k)
    key2 = torch.where(hi == b1, (bits >> _SHIFT2) & (_BINS - 1), _BINS)
    b2, _ = _kth_bin(torch.bincount(key2, minlength=_BINS + 1)[:_BINS], k - above)
    return ((b1 << _SHIFT1) | (b2 << _SHIFT2)).to(torch.int32), bad


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the first ``count`` True entries, ascending; no host wait where torch has
    nonzero_static for the device."""
    try:
        return torch.nonzero_static(mask, size=count).reshape(-1)
    except (NotImplementedError, RuntimeError):
        return torch.nonzero(mask).reshape(-1)[:count]


def _mean(vals: torch.Tensor, count: int) -> torch.Tensor:
    """(1,) fp32 mean of the kept values; float64 where the fp32 sum overflowed (huge finite values)."""
    n = max(count, 1)
    return widen(vals.sum() / n, vals.sum(dtype=torch.float64) / n).reshape(1)


def select_bucket(xs: List[torch.Tensor], ks: List[int], *, sign: Optional[str] = None,
                  mean: bool = False) -> BucketSelection:
    """About the k largest |x| of each flat float32 tensor in ``xs``, all at once.

    sign: None (both signs), "pos" / "neg" (keep only that side of the selection: RedSync's
    alternating sign), or "larger" (per layer, the side whose mean magnitude is larger: SBC).
    mean: return each layer's mean over what it kept instead of the values (sign_mean).
    """
    if sign not in (None, "pos", "neg", "larger"):
        raise ValueError(f"sign={sign!r} is not one of None, 'pos', 'neg', 'larger'")
    if len(xs) != len(ks) or any(x.dim() != 1 or x.dtype != torch.float32 for x in xs):
        raise ValueError("select_bucket: pass one flat float32 tensor per k")
    keeps, stats = [], []
    for x, k in zip(xs, ks):
        bits = x.abs().view(torch.int32)
        thr, bad = _threshold(bits, k)
        # zeros carry nothing; a layer with NaN/Inf sends nothing (the step fails on every rank)
        sel = (bits >= thr) & (bits > 0) & ~bad
        keep = sel
        if sign == "larger":
            pos, neg = sel & (x > 0), sel & (x < 0)
            mu_pos = torch.where(pos, x, 0.0).sum() / pos.count_nonzero().clamp(min=1)
            mu_neg = -torch.where(neg, x, 0.0).sum() / neg.count_nonzero().clamp(min=1)
            keep = torch.where(mu_pos >= mu_neg, pos, neg)
        elif sign is not None:
            keep = sel & (x > 0 if sign == "pos" else x < 0)
        keeps.append(keep)
        kept = keep.count_nonzero()
        stats += [kept, sel.count_nonzero() if sign is not None else kept, bad]
    # the one host wait: every layer's counts and flags in one transfer
    host = torch.stack([s.to(torch.int64) for s in stats]).tolist()
    indices, values, selected, nonfinite = [], [], [], []
    for i, (x, k, keep) in enumerate(zip(xs, ks, keeps)):
        count, n_sel, bad = host[3 * i:3 * i + 3]
        # ties within 128 ulps past 2k: the first 2k go, the rest stays in the residual
        count = min(count, 2 * k)
        idx = _positions(keep, count)
        vals = x.index_select(0, idx)
        indices.append(idx)
        values.append(_mean(vals, count) if mean else vals)
        selected.append(min(n_sel, 2 * k))
        nonfinite.append(bool(bad))
    return BucketSelection(indices, values, selected, nonfinite)
