"""The passes a layer-at-a-time backend offers, so that the searches (``searches.py``) are written once.

    stats()               -> (max|x|, mean|x|), raising on NaN/Inf
    count(thresholds)     -> [#{|x| > t} for t in thresholds], ``levels`` TBS levels per pass
    select(t, cap, check, values) -> (indices of |x| > t ascending or None past cap,
                                      count, their |x| if values)
    sub(vals)             -> the same backend over a gathered subset
    histogram_search(k)   -> optional: every probe at once from two histograms (CuPy)

:class:`TorchPasses` is the reference in plain torch ops (any device and dtype); the native
CPU kernel (``native.py``) and CuPy's (``cupy_kernels.py``) are the others. A pass the memory
made while it computed x (:class:`Scan`, asked for by a :class:`ScanRequest`) can stand in for
a backend's first stats() and select(), so x is not read again.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from .reference import above

_F32 = struct.Struct("f")
_SAMPLE_AIM = 1.15       # sampled: first threshold targets 1.15k hits


def cast(t: float, dtype: torch.dtype) -> float:
    """Round a threshold to x's dtype once, so every pass compares against the same value."""
    if dtype == torch.float32 and abs(t) < 3e38:  # struct rounds like torch, no tensor
        return _F32.unpack(_F32.pack(t))[0]
    if dtype == torch.float64:
        return float(t)
    return float(torch.tensor(t, dtype=torch.float64).to(dtype))


def sample_plan(n: int, k: int, fraction: float) -> Tuple[int, int]:
    """DGC's sample of n elements: (stride, ks): every stride-th element, >= ``fraction`` of them
    and >= ~1000 so small layers sample sanely; the threshold is the ks-th largest |x| there,
    aimed at ~1.15k hits so sampling noise mostly lands inside DGC's accept band [k, 1.3k]."""
    stride = max(1, min(int(1.0 / fraction), n // 1000))
    size = -(-n // stride)
    return stride, min(size, int(math.ceil(_SAMPLE_AIM * k * size / n)) + 1)


def sample_threshold(sample: torch.Tensor, ks: int, dtype: torch.dtype) -> float:
    """The ks-th largest |sample|, in x's dtype."""
    return cast(float(torch.topk(sample.abs(), ks, sorted=True).values[-1]), dtype)


@dataclass(frozen=True)
class ScanRequest:
    """What the selection that follows wants from the pass that computes x: statistics
    always, and the indices and |x| above ``threshold`` up to ``cap`` (threshold=inf:
    none, a search step). ``sample`` (DGC's (stride, ks), ``sample_plan``): the threshold
    is taken from the sample of r + g first. ``native.py:compensate_scan`` returns the
    :class:`Scan` when it fused it."""
    threshold: float = math.inf
    cap: int = 0
    sample: Optional[Tuple[int, int]] = None


@dataclass
class Scan:
    threshold: float
    cap: int
    indices: torch.Tensor     # empty past cap or without a threshold
    values: torch.Tensor      # their |x|
    count: int                # exact count above threshold
    finite: bool
    max: float
    sum: float


class Compensated(NamedTuple):
    """What a memory's compensation hands to the compressor (the exchange's step 1 to step 2):
    x = r + g (DGC: r + u) in this step's buffer, which the memory update then overwrites with
    the new residual; ``first``: the selection's first pass over x, made while x was written (a
    :class:`Scan` for a layer, the first histogram for a bucket), or None; ``velocity``: a
    bucket's step velocity, zeroed where values are sent (DGC's masking), or None."""
    x: torch.Tensor
    first: Any = None
    velocity: Optional[torch.Tensor] = None


class TorchPasses:
    """Plain torch ops (any device/dtype): |x| is built once, then one kernel per probe."""

    def __init__(self, flat: torch.Tensor, err: ValueError, scan: Optional[Scan] = None):
        self.x, self.err = flat, err
        self.a = flat.abs()
        self.levels = 2 if flat.is_cuda else 1  # CUDA: batch launches per sync; CPU: passes cost

    def stats(self) -> Tuple[float, float]:
        mx, s = torch.stack([self.a.max().double(), self.a.sum(dtype=torch.float64)]).tolist()
        if not (math.isfinite(mx) and math.isfinite(s)):
            raise self.err
        return mx, s / self.a.numel()

    def count(self, thr: List[float]) -> List[int]:
        return torch.stack([torch.count_nonzero(self.a > t) for t in thr]).tolist()

    def select(self, thr: float, cap: int, check: bool, values: bool = False):
        if check and not math.isfinite(float(self.a.max())):
            raise self.err
        return above(self.a, thr, cap, values)

    def sub(self, vals: torch.Tensor) -> "TorchPasses":
        return TorchPasses(vals, self.err)
