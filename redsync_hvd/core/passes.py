"""The compute paths under select_topk: fused passes over one flat tensor.

Each backend offers the same four operations, so the searches in selection.py are
written once:

    stats()               -> (max|x|, mean|x|), raising on NaN/Inf
    count(thresholds)     -> [#{|x| > t} for t in thresholds], ``levels`` TBS levels per pass
    select(t, cap, check, values) -> (indices of |x| > t ascending or None past cap,
                                      count, their |x| if values)
    sub(vals)             -> the same backend over a gathered subset

* ``_Native``: the C++/OpenMP module (CPU float32/float64), see ``_native/``. Its first
  stats() and select() may come from a ``Scan``: the same pass made by the residual
  memory while it computed x (``compensate_scan``), so x is not read again.
* ``CudaPasses``: CuPy kernels (CUDA float32), see ``cuda_select.py``.
* ``_Torch``: plain torch ops, any device and dtype.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Tuple

import torch

from redsync_hvd.core import _native, cuda_select

_NATIVE_LEVELS = 3       # TBS levels per native count pass: 7 compares/elem stays memory-bound


def native_available() -> bool:
    return _native.load() is not None


class NonFiniteError(ValueError):
    """x holds NaN or Inf. Every search checks in a pass it makes anyway, so callers that
    select from every gradient need no finite-check pass of their own."""


def _nonfinite(name: Optional[str], x: torch.Tensor) -> ValueError:
    where = name or "tensor of shape %s" % (tuple(x.shape),)
    return NonFiniteError("non-finite gradient values in %s (NaN or Inf): refusing to select" % where)


_F32 = struct.Struct("f")
_SAMPLE_AIM = 1.15       # sampled: first threshold targets 1.15k hits


def _cast(t: float, dtype: torch.dtype) -> float:
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
    return _cast(float(torch.topk(sample.abs(), ks, sorted=True).values[-1]), dtype)


@dataclass(frozen=True)
class ScanRequest:
    """What the selection that follows wants from the pass that computes x: statistics
    always, and the indices and |x| above ``threshold`` up to ``cap`` (threshold=inf:
    none, a search step). ``sample`` (DGC's (stride, ks), ``sample_plan``): the threshold
    is taken from the sample of r + g first. ``compensate_scan`` returns the :class:`Scan`
    when it fused it."""
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


# Below this many elements a layer's streams stay in cache, so fusing saves no memory
# traffic, while the call costs more Python than torch.add (resnet20's 59 small tensors)
_FUSE_MIN_NUMEL = 1 << 16
_EMPTY = torch.empty(0)


def compensate_scan(residual: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                    request: Optional[ScanRequest], velocity: Optional[torch.Tensor] = None,
                    velocity_out: Optional[torch.Tensor] = None, momentum: float = 0.0,
                    nesterov: bool = False, fuse: bool = True) -> Optional[Scan]:
    """out = residual + grad (with ``velocity``: DGC's velocity_out = momentum*velocity + grad,
    out = residual + velocity_out, or + grad + momentum*velocity_out with nesterov), fused
    with the first selection pass over out. Returns that pass (a :class:`Scan`), or None,
    having done nothing, when the native kernel cannot take these tensors or ``fuse`` is off
    (benchmarks time the unfused pair that way): the caller then computes out with torch ops."""
    if not fuse or residual.numel() < _FUSE_MIN_NUMEL:
        return None
    mod = _native.load()
    tensors = (residual, grad, out) + ((velocity, velocity_out) if velocity is not None else ())
    if mod is None or not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                              for t in tensors):
        return None
    empty = _EMPTY
    thr = request.threshold if request is not None else math.inf
    cap = request.cap if request is not None else 0
    if request is not None and request.sample is not None:
        stride, ks = request.sample
        thr = sample_threshold(_sampled_x(residual, grad, velocity, momentum, nesterov, stride), ks, torch.float32)
    idx, vals, c, finite, mx, s = mod.compensate_scan(
        residual, grad, out, velocity if velocity is not None else empty,
        velocity_out if velocity_out is not None else empty, float(momentum), bool(nesterov), float(thr), int(cap))
    return Scan(thr, cap, idx, vals, c, finite, mx, s)


def _sampled_x(residual, grad, velocity, momentum: float, nesterov: bool, stride: int) -> torch.Tensor:
    """x at every stride-th element, by the torch ops of the unfused compensation (where the
    native kernel rounds DGC's momentum differently, the selection's own pass is made instead)."""
    r, g = residual[::stride], grad[::stride]
    if velocity is None:
        return r + g
    u = torch.add(g, velocity[::stride], alpha=momentum)
    return r + (g + momentum * u if nesterov else u)


class _Native:
    """Fused passes from the C++ module; x is a contiguous 1-D CPU float32/float64."""

    levels = _NATIVE_LEVELS

    def __init__(self, mod: Any, flat: torch.Tensor, err: ValueError, scan: Optional[Scan] = None):
        self.m, self.x, self.err = mod, flat, err
        self.scan = scan   # consumed by the first stats() and the first select() it matches

    def stats(self) -> Tuple[float, float]:
        if self.scan is not None and not math.isnan(self.scan.max):
            mx, s, finite = self.scan.max, self.scan.sum, self.scan.finite
            self.scan.max = math.nan   # used
            if not finite:
                raise self.err
            return mx, s / self.x.numel()
        mx, s = self.m.stats(self.x)
        if not math.isfinite(s):  # float partial sums may overflow: confirm before raising
            if not bool(torch.isfinite(self.x).all()):
                raise self.err
            s = float(self.x.double().abs().sum())
        return mx, s / self.x.numel()

    def count(self, thr: List[float]) -> List[int]:
        return self.m.count_multi(self.x, torch.tensor(thr, dtype=self.x.dtype)).tolist()

    def select(self, thr: float, cap: int, check: bool, values: bool = False):
        """(indices of |x| > thr or None past cap, count, their |x| if values)."""
        scan = self.scan
        if scan is not None and scan.threshold == thr and scan.cap == cap:
            scan.threshold = math.nan   # used
            if check and not scan.finite:
                raise self.err
            return (scan.indices, scan.count, scan.values if values else None) if scan.count <= cap \
                else (None, scan.count, None)
        idx, vals, c, finite = self.m.select_above(self.x, thr, cap, check, values)
        if check and not finite:
            raise self.err
        return (idx, c, vals if values else None) if c <= cap else (None, c, None)

    def sub(self, vals: torch.Tensor) -> "_Native":
        self.scan = None
        return _Native(self.m, vals.contiguous(), self.err)


class _Torch:
    """Plain torch ops (any device/dtype): |x| is built once, then one kernel per probe."""

    def __init__(self, flat: torch.Tensor, err: ValueError):
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
        idx = torch.nonzero(self.a > thr).flatten()
        c = idx.numel()
        return (idx, c, self.a[idx] if values else None) if c <= cap else (None, c, None)

    def sub(self, vals: torch.Tensor) -> "_Torch":
        return _Torch(vals, self.err)


def _backend(flat: torch.Tensor, choice: str, err: ValueError, scan: Optional[Scan] = None):
    if flat.is_cuda:
        ok = flat.dtype == torch.float32
        kernels = cuda_select.load() if choice in ("auto", "cuda") and ok else None
        if choice == "cuda" and kernels is None:
            why = cuda_select.load_error if ok else "needs a CUDA float32 tensor"
            raise ValueError("backend='cuda' unavailable: %s" % why)
        if kernels is not None:
            return cuda_select.CudaPasses(kernels, flat.contiguous(), err)
        if choice == "native":
            raise ValueError("backend='native' unavailable: needs a CPU float32/float64 tensor")
        return _Torch(flat, err)
    ok = flat.dtype in (torch.float32, torch.float64)
    mod = _native.load() if choice in ("auto", "native") and ok else None
    if choice == "native" and mod is None:
        why = _native.load_error if ok else "needs a CPU float32/float64 tensor"
        raise ValueError("backend='native' unavailable: %s" % why)
    if choice == "cuda":
        raise ValueError("backend='cuda' unavailable: needs a CUDA float32 tensor")
    return _Native(mod, flat.contiguous(), err, scan) if mod is not None else _Torch(flat, err)
