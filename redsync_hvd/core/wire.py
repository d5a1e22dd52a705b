"""What a value becomes on the wire: every lossy cast clamps to the wire type's finite range.

A cast to a narrower float type rounds a finite value beyond the type's largest finite
number to inf: fp16's is 65504, so one gradient element of 1e5 sent as fp16 would arrive as
inf, the average would be inf, and the residual (x minus what was sent) would hold -inf for
good. bf16 does the same to fp32 values near 3.4e38, and a float64 figure (a norm, a mean)
rounded to an fp32 wire does it past 3.4e38. :func:`to_wire` clamps first, so the value sent
is the nearest one the wire can carry, and error feedback (the memory keeps x minus what
was sent) keeps the difference: nothing is lost, nothing becomes inf.

NaN stays NaN; +-inf become +-max. The exchange's finite check reads the values before they
reach the wire (the gradient, or the compensated x), so a non-finite gradient still fails
the step on every rank.

Sums that overflow fp32 although every term is finite (the mean of huge values, a norm's
sum of squares) are recomputed in float64 where the fp32 result is inf: :func:`wide_mean`,
:func:`wide_norm`. :func:`finite_evidence` is a per-layer figure that is non-finite exactly
when the layer holds NaN or Inf (a plain sum also overflows on finite values).
"""
from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=None)
def wire_limit(dtype: torch.dtype, summands: int = 1) -> float:
    """The largest value of ``dtype`` whose ``summands``-fold sum is still finite in ``dtype``:
    its largest finite number divided by ``summands``, rounded down to a ``dtype`` value (an
    allreduce that sums the messages in ``dtype`` then stays finite at every partial sum)."""
    if summands < 1:
        raise ValueError(f"summands={summands} must be >= 1")
    if summands == 1:   # the type's own largest number: no tensor op (a kernel launcher asks for it)
        return float(torch.finfo(dtype).max)
    exact = torch.finfo(dtype).max / summands
    limit = torch.tensor(exact, dtype=torch.float64).to(dtype)
    if float(limit) > exact:
        limit = torch.nextafter(limit, torch.zeros((), dtype=dtype))
    return float(limit)


def to_wire(values: torch.Tensor, dtype: torch.dtype, *, summands: int = 1) -> torch.Tensor:
    """``values`` as ``dtype``, each clamped to +-:func:`wire_limit` (``dtype``, ``summands``)
    first, so a finite value stays finite. A cast to the same or a wider type with
    ``summands=1`` clamps nothing (it returns ``values.to(dtype)``, possibly ``values``)."""
    if not dtype.is_floating_point:
        raise ValueError(f"to_wire: {dtype} is not a floating-point wire type")
    limit = wire_limit(dtype, summands)
    if summands == 1 and limit >= torch.finfo(values.dtype).max:
        return values.to(dtype)
    return values.clamp(-limit, limit).to(dtype)


def widen(narrow: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """``narrow`` (an fp32 figure), or where it is inf, ``wide`` (the same figure computed in
    float64) clamped to fp32's range: bit for bit the fp32 figure wherever that is finite, and
    no host read to decide."""
    return torch.where(torch.isinf(narrow), to_wire(wide, torch.float32), narrow)


def wide_mean(values: torch.Tensor) -> torch.Tensor:
    """The fp32 mean of ``values`` (0-dim); where the fp32 sum overflowed although the mean
    fits (huge finite values), the float64 mean (on the CPU computed only then, as in
    :func:`wide_norm`)."""
    narrow = values.mean(dtype=torch.float32)
    if narrow.device.type == "cpu" and not math.isinf(float(narrow)):
        return narrow
    return widen(narrow, values.mean(dtype=torch.float64))


def wide_norm(values: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``torch.linalg.vector_norm(values, dim=dim)`` in fp32; where that is inf (the sum of
    squares overflows from about 1.8e19 per element), the float64 norm clamped to fp32's range.
    On the CPU, where reading a result costs nothing, the float64 norm is computed only when
    the fp32 one overflowed (no host read elsewhere)."""
    narrow = torch.linalg.vector_norm(values, dim=dim, keepdim=keepdim)
    if narrow.device.type == "cpu" and not bool(torch.isinf(narrow).any()):
        return narrow
    return widen(narrow, torch.linalg.vector_norm(values, dim=dim, keepdim=keepdim, dtype=torch.float64))


def finite_evidence(values: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor that is NaN or Inf exactly when ``values`` holds NaN or Inf: the largest
    magnitude (NaN propagates through the maximum). A sum would also turn huge finite
    values into inf and blame a finite gradient. On the CPU the largest magnitude is taken as
    max(max, -min) of one ``aminmax`` pass: the same number, where torch's inf-norm there runs
    8x slower (34 against 4 ms for 12M fp32 elements on one core of the Xeon VM), a cost every
    step paid on every layer."""
    if values.numel() == 0:   # nothing that is not finite (torch's inf-norm refuses an empty tensor)
        return values.new_zeros(())
    if values.device.type != "cpu":
        return torch.linalg.vector_norm(values, ord=float("inf"))
    low, high = torch.aminmax(values)
    return torch.maximum(high, -low)
