"""The native CPU backend: the C++/OpenMP passes of ``core/_native/select_kernels.cpp``.

:class:`NativePasses` runs the searches' passes on a contiguous 1-D CPU float32/float64 x
without materialising |x| or a mask: a stats pass (max, sum, finite check), a count pass
giving ``LEVELS`` probes of the TBS tree at once (every threshold of the subtree held in
registers), an index pass that also returns |x| of the hits. Its first stats() and
select() may come from a :class:`~.passes.Scan`: the same pass made while the memory
computed x (:func:`compensate_scan`), so x is not read again. The torch reference of every
pass is ``passes.py:TorchPasses``; ``load`` keeps the module (``core/_native``: built ahead of
time by ``python redsync_hvd/core/_native/build.py``).
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import torch

from .. import _native
from ..compensate import torch_compensate
from .passes import Scan, ScanRequest, sample_threshold
from .registry import Loader, Unavailable

LEVELS = 3       # TBS levels per native count pass: 7 compares/elem stays memory-bound


def _find() -> Any:
    try:
        return _native.find()
    except _native.NotLoaded as e:
        raise Unavailable(str(e)) from None


load = Loader(_find)


def available() -> bool:
    return load() is not None


def passes(flat: torch.Tensor, err: ValueError, scan: Optional[Scan] = None) -> "NativePasses":
    """The backend's form in the registry: passes over ``flat``."""
    return NativePasses(load(), flat.contiguous(), err, scan)


class NativePasses:
    """Fused passes from the C++ module; x is a contiguous 1-D CPU float32/float64. They rank
    |x|, or with ``side`` 1 / -1 (float32) one sign's magnitude, max(x, 0) / max(-x, 0): a sign
    rule's candidates without a copy of x clamped to its side. The finite check covers all of x."""

    levels = LEVELS

    def __init__(self, mod: Any, flat: torch.Tensor, err: ValueError, scan: Optional[Scan] = None, side: int = 0):
        self.m, self.x, self.err, self.side = mod, flat, err, side
        self.scan = scan   # of the same keys; consumed by the first stats() and the first select() it matches

    def stats(self) -> Tuple[float, float]:
        if self.scan is not None and not math.isnan(self.scan.max):
            mx, s, finite = self.scan.max, self.scan.sum, self.scan.finite
            self.scan.max = math.nan   # used
            if not finite:
                raise self.err
            return mx, s / self.x.numel()
        mx, s = self.m.stats(self.x, self.side)
        if not math.isfinite(s):  # float partial sums may overflow: confirm before raising
            if not bool(torch.isfinite(self.x).all()):
                raise self.err
            x = self.x.double()
            s = float((x.abs() if self.side == 0 else (x * self.side).clamp(min=0.0)).sum())
        return mx, s / self.x.numel()

    def count(self, thr: List[float]) -> List[int]:
        return self.m.count_multi(self.x, torch.tensor(thr, dtype=self.x.dtype), self.side).tolist()

    def select(self, thr: float, cap: int, check: bool, values: bool = False):
        """(indices of key > thr or None past cap, count, their keys if values)."""
        scan = self.scan
        if scan is not None and scan.threshold == thr and scan.cap == cap:
            scan.threshold = math.nan   # used
            if check and not scan.finite:
                raise self.err
            return (scan.indices, scan.count, scan.values if values else None) if scan.count <= cap \
                else (None, scan.count, None)
        idx, vals, c, finite = self.m.select_above(self.x, thr, cap, check, values, self.side)
        if check and not finite:
            raise self.err
        return (idx, c, vals if values else None) if c <= cap else (None, c, None)

    def sub(self, vals: torch.Tensor) -> "NativePasses":
        self.scan = None
        return NativePasses(self.m, vals.contiguous(), self.err)   # vals are keys already: |.| ranks them



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
    mod = load()
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
    return torch_compensate(residual[::stride], grad[::stride],
                            velocity_in=None if velocity is None else velocity[::stride], momentum=momentum,
                            nesterov=nesterov)


