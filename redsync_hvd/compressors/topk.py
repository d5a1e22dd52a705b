"""Sparse baselines: exact top-k (over allgather) and random-k (shared positions, allreduce)."""
from __future__ import annotations

import math

import torch

from .base import Compressor, Layer, Message


def k_for(layer: Layer) -> int:
    return max(1, math.ceil(layer.density * layer.numel))


class TopKCompressor(Compressor):
    """k = ceil(density * n) largest magnitudes, sent as (index, fp32 value) pairs."""
    collective = "allgather"

    def wire_dtypes(self, layer: Layer) -> tuple:
        return (layer.index_dtype, torch.float32)

    def select(self, x: torch.Tensor, k: int, layer: Layer) -> torch.Tensor:
        # the baseline is torch.topk itself; RedSync's fast selections live in core.selection
        return torch.topk(x.abs(), k, sorted=False).indices

    def compress(self, x, layer, step):
        k = k_for(layer)
        idx = self.select(x, k, layer)
        vals = x.index_select(0, idx)
        return Message([idx.to(layer.index_dtype), vals], ("indices", "values"), selected=idx.numel(), k=k)

    def sent_indices(self, message, layer):
        return message.tensors[0]

    def decompress_add(self, out, tensors, layer, alpha=1.0):
        idx, vals = tensors
        if idx.numel():
            out.index_add_(0, idx.to(device=out.device, dtype=torch.int64), vals.to(out), alpha=alpha)


class RandomKCompressor(Compressor):
    """k positions drawn from a generator seeded by (seed, step, layer): identical on every
    rank with no communication, so values alone are averaged by allreduce. Cheap to select,
    but blind to magnitude: it needs the residual to converge."""
    collective = "allreduce"

    def wire_dtypes(self, layer: Layer) -> tuple:
        return (torch.float32,)

    def _positions(self, layer: Layer, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((self.config.seed, step, layer.index)) & 0x7FFFFFFF)
        k = k_for(layer)
        return torch.randperm(layer.numel, generator=gen)[:k].to(layer.device)

    def compress(self, x, layer, step):
        idx = self._positions(layer, step)
        # decompress (for the residual now, for the average later) needs this step's positions
        self._step_positions[layer.index] = idx
        return Message([x.index_select(0, idx)], ("values",), selected=idx.numel(), k=idx.numel())

    def decompress_add(self, out, tensors, layer, alpha=1.0):
        out.index_add_(0, self._step_positions[layer.index], tensors[0].to(out), alpha=alpha)

    def __init__(self, config=None):
        super().__init__(config)
        self._step_positions: dict = {}
