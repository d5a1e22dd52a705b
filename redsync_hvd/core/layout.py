"""How layers are laid out for the exchange: k per layer, and the allgather buckets.

The exchange, the cost model and the benchmarks all ask these two questions; the answers
live here once so that a prediction describes the collectives the exchange really issues.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Sequence


@functools.lru_cache(maxsize=1 << 16)   # every layer asks several times a step, with few distinct densities
def k_of(numel: int, density: float) -> int:
    """k = ceil(density * numel): at least 1 for a non-empty layer, at most numel."""
    return 0 if numel <= 0 else min(numel, max(1, math.ceil(density * numel)))


def buckets(numels: Sequence[int], bucket_bytes: float,
            include: Callable[[int], bool] = lambda i: True) -> list[list[int]]:
    """Fixed allgather buckets: indices of ``numels`` (registration order) for which ``include(i)``,
    taken in reverse order (the order backward produces gradients); a new bucket starts whenever
    the next layer would take the bucket past ``bucket_bytes`` of dense fp32 bytes. Every rank
    computes the same partition from the same layer list, so every rank issues the same collectives."""
    out, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        if not include(i):
            continue
        if current and size + 4 * numels[i] > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += 4 * numels[i]
    return out + ([current] if current else [])
