"""The torch reference of what several selection paths share, written once.

Each backend's kernel of these steps (CuPy's histograms in ``cupy_kernels.py``, Triton's
``_pick``/``_wire`` in ``triton_kernels.py``, the native ``select_above``) is tested against
the function here:

* :func:`kth_bin`: in a histogram ordered by value, the bin holding the k-th largest element;
* :func:`histogram_threshold`: the k-th largest |x| to 128 float ulps from two 4096-bin
  histograms of the bit patterns of |x| (non-negative floats order like their bits);
* :func:`above`: the positions of |x| > t (select by threshold);
* :func:`keep_side`: the sign rule applied to a selection; :func:`kept_mean`: its mean.

The wire clamp's reference is ``core/wire.py:to_wire``.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy
import torch

from ..wire import wide_mean, widen

BINS = 4096                    # bins per level of the two-level histogram
SHIFT1, SHIFT2 = 19, 7         # 12 bits each of a non-negative float32's 31
NONFINITE_BIN = 0x7F800000 >> SHIFT1   # level-1 bins from here hold NaN and Inf


def kth_bin(hist: torch.Tensor, need):
    """Per row of ``hist`` (..., B), bins ordered by value: the bin b holding the need-th largest
    element (``need``: an int, or a tensor of one per row), clamped to 0 where there are fewer,
    and how many elements lie in the bins above b. Both on the device: nothing is read back."""
    c = hist.flip(-1).cumsum(-1).flip(-1)                  # c[b]: elements in bins >= b
    n = need.unsqueeze(-1) if torch.is_tensor(need) else need
    b = ((c >= n).sum(-1, keepdim=True) - 1).clamp_(min=0)
    above = (c.gather(-1, b) - hist.gather(-1, b)).squeeze(-1)
    return b.squeeze(-1), above


def histogram_threshold(first: Callable[[], torch.Tensor], second: Callable[[torch.Tensor], torch.Tensor],
                        k, count: bool = False):
    """Bits t of the k-th largest |x|, rounded down to 128 ulps: |x| >= t for at least k elements.
    ``first()``: the 4096-bin histogram of bits(|x|) >> 19; ``second(b1)``: the histogram of
    (bits >> 7) & 4095 over the elements in level-1 bin b1. With ``count``, also how many
    elements have bits >= t. On the device; each backend brings its two histogram passes."""
    h1 = first()
    b1, above1 = kth_bin(h1, k)
    h2 = second(b1)
    b2, above2 = kth_bin(h2, k - above1)
    t = (b1 << SHIFT1) | (b2 << SHIFT2)
    if not count:
        return t
    return t, above1 + above2 + h2.gather(-1, b2.reshape(-1)).reshape(b2.shape)


def torch_histograms(bits: torch.Tensor):
    """(first, second) for :func:`histogram_threshold` by ``torch.bincount`` over bits(|x|)
    (int32); the first histogram also holds the non-finite values (bins >= NONFINITE_BIN)."""
    hi = bits >> SHIFT1

    def first():
        return torch.bincount(hi, minlength=BINS)

    def second(b1):
        key2 = torch.where(hi == b1, (bits >> SHIFT2) & (BINS - 1), BINS)
        return torch.bincount(key2, minlength=BINS + 1)[:BINS]
    return first, second


def above(a: torch.Tensor, t: float, cap: int, values: bool = False):
    """(positions of a > t ascending, or None past ``cap``; their count; a there if ``values``).
    ``a`` holds |x|."""
    idx = torch.nonzero(a > t).flatten()
    c = idx.numel()
    return (idx, c, a[idx] if values else None) if c <= cap else (None, c, None)


def keep_side(x: torch.Tensor, sign: Optional[str], among: Optional[torch.Tensor] = None,
              host: bool = False) -> torch.Tensor:
    """The mask of what the sign rule keeps of x (of ``among``, a mask, where given): "pos" x > 0,
    "neg" x < 0, "larger" the side whose mean magnitude is larger (SBC; ties: positive), None
    both. No host read, unless ``host`` (a CPU caller's choice: there a read costs nothing and
    a small op does) has the "larger" comparison made on the host, to the same decision."""
    def of(mask):
        return mask if among is None else mask & among
    if sign == "pos":
        return of(x > 0)
    neg = of(x < 0)
    if sign == "neg":
        return neg
    pos = of(x > 0)
    if sign is None:
        return pos | neg
    if host and x.dtype == torch.float32:
        return pos if _positive_larger(x, pos, neg) else neg
    mu_pos = torch.where(pos, x, 0.0).sum() / pos.count_nonzero().clamp(min=1)
    mu_neg = -torch.where(neg, x, 0.0).sum() / neg.count_nonzero().clamp(min=1)
    return torch.where(mu_pos >= mu_neg, pos, neg)


def _positive_larger(x: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> bool:
    """``keep_side``'s device comparison, made on the host from the same fp32 sums and counts: fp32
    division is IEEE's on both sides, so the decision is the same bit for bit."""
    f = numpy.float32
    sums = float(torch.where(pos, x, 0.0).sum()), float(torch.where(neg, x, 0.0).sum())
    counts = max(int(pos.count_nonzero()), 1), max(int(neg.count_nonzero()), 1)
    return bool(f(sums[0]) / f(counts[0]) >= -f(sums[1]) / f(counts[1]))


def kept_mean(values: torch.Tensor, host: bool = False) -> torch.Tensor:
    """(1,) float32: the signed mean of the kept values (float64 where the fp32 sum overflows on
    finite values, ``wire.py:widen``: bit for bit the fp32 mean elsewhere); 0 for none. No host
    read (a bucket's selection waits once, for its counts), unless ``host``: then the float64
    mean only where the fp32 one overflowed (``wire.py:wide_mean``), the same bits."""
    if not values.numel():
        return torch.zeros(1, device=values.device)
    if host:
        return wide_mean(values).reshape(1)
    return widen(values.mean(dtype=torch.float32), values.mean(dtype=torch.float64)).reshape(1)
