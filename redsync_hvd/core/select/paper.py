"""RedSync's two selections as the paper writes them (Fang et al., JPDC 2019), one probe at a time.

Both search a threshold t on |x| between mean(|x|) and max(|x|) through one question,
``count(t) = #{i : |x_i| > t}``:

    trimmed top-k:  r = 1 - eps, 1 - 2 eps, ... until count(mean + r (max - mean)) >= k;
                    the exact top-k among those candidates
    threshold binary search (tbs):
                    lo, hi = 0, 1; at most P times:
                        r = (lo + hi) / 2; c = count(mean + r (max - mean))
                        k <= c <= 2k: accept, send the c elements above it
                        c < k: hi = r   else: lo = r
                    never accepted: the exact top-k

``searches.py`` runs the same searches fast (several probes per pass, fused passes, a
native kernel, CUDA histograms); the tests check it against these functions.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def count_above(x: torch.Tensor) -> Callable[[float], int]:
    """The one question both searches ask, answered by a plain pass over |x|."""
    a = x.detach().reshape(-1).abs()
    return lambda t: int((a > t).sum())


def _threshold(x: torch.Tensor, r: float) -> float:
    """mean + r (max - mean) of |x|, rounded to x's dtype (every pass then compares the same value)."""
    a = x.detach().reshape(-1).abs()
    mean, mx = float(a.double().sum()) / a.numel(), float(a.max())
    return float(torch.tensor(mean + r * (mx - mean), dtype=torch.float64).to(x.dtype))


def _above(x: torch.Tensor, t: float) -> torch.Tensor:
    return (x.detach().reshape(-1).abs() > t).nonzero().flatten()


def _exact(x: torch.Tensor, k: int, among: Optional[torch.Tensor] = None) -> torch.Tensor:
    a = x.detach().reshape(-1).abs()
    if among is None:
        return torch.topk(a, k, sorted=False).indices
    return among[torch.topk(a[among], k, sorted=False).indices]


def tbs(x: torch.Tensor, k: int, count: Callable[[float], int], max_probes: int = 20) -> torch.Tensor:
    """Threshold binary search: the positions above the first threshold with k <= count <= 2k."""
    lo, hi = 0.0, 1.0
    for _ in range(max_probes):
        r = (lo + hi) / 2
        t = _threshold(x, r)
        c = count(t)
        if k <= c <= 2 * k:
            return _above(x, t)
        lo, hi = (lo, r) if c < k else (r, hi)
    return _exact(x, k)


def trimmed(x: torch.Tensor, k: int, count: Callable[[float], int], eps: float = 0.2) -> torch.Tensor:
    """Trimmed top-k: the exact top-k among the elements above the first ratio with >= k of them."""
    for j in range(1, int(math.ceil(1.0 / eps)) + 1):
        r = max(1.0 - j * eps, 0.0)
        if count(_threshold(x, r)) >= k:
            return _exact(x, k, among=_above(x, _threshold(x, r)))
    return _exact(x, k)
