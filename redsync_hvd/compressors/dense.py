"""Dense baselines: fp32 (Horovod's default) and fp16 allreduce."""
from __future__ import annotations

import torch

from ..core.wire import to_wire
from .base import Compressor, Layer, Message, Wire


class NoneCompressor(Compressor):
    """Send the gradient as it is; Horovod averages it (and fuses small layers)."""
    collective = "allreduce"
    passthrough = True
    dense_wire = True

    def wire(self, layer: Layer) -> Wire:
        return Wire((torch.float32,), ("values",), (layer.numel,), fixed=True)

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        return Message([x], ("values",))   # x itself: dense layers have no memory to update

    def decompress_add(self, out, tensors, layer, alpha=1.0, ctx=None):
        out.add_(tensors[0].to(out.dtype), alpha=alpha)


class FP16Compressor(NoneCompressor):
    """Half-precision values: 2x fewer bytes; rounding error is not fed back. The allreduce sums
    the workers' fp16 values in fp16, so each is clamped to 65504 / workers: a sum that stays
    finite."""
    passthrough = False

    def wire(self, layer: Layer) -> Wire:
        return Wire((torch.float16,), ("values",), (layer.numel,), fixed=True)

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        workers = self.comm.size if self.comm is not None else 1
        return Message([to_wire(x, torch.float16, summands=workers)], ("values",))
