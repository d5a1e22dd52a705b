"""Sparse baselines: exact top-k (over allgather) and random-k (shared positions, allreduce).

    top-k:     idx = topk(|x|, k); send (idx, x[idx])                  every rank its own idx
    random-k:  idx = randperm(n, seed(step, layer))[:k]; send x[idx]    idx shared, never sent
"""
from __future__ import annotations

import torch

from ..core.select import Contract, select, single
from .base import Compressor, Layer, Message, Wire

# torch.topk itself, unchecked: RedSync's fast selections are the other strategies of core/select
TOPK = Contract("exact", finite=False)


class TopKCompressor(Compressor):
    """k = ceil(density * n) largest magnitudes, sent as (index, fp32 value) pairs."""
    collective = "allgather"

    def wire(self, layer: Layer) -> Wire:
        return Wire((layer.index_dtype, torch.float32), ("indices", "values"), (layer.k, layer.k))

    def compress(self, x, layer, step, first=None):
        idx = select(single(layer.numel, layer.k), x, TOPK).positions
        return Message([idx.to(layer.index_dtype), x.index_select(0, idx)], ("indices", "values"),
                       selected=idx.numel(), k=layer.k, positions=idx)

    def decompress_add(self, out, tensors, layer, alpha=1.0, ctx=None):
        idx, vals = tensors
        if idx.numel():
            out.index_add_(0, idx.to(device=out.device, dtype=torch.int64), vals.to(out), alpha=alpha)


class RandomKCompressor(Compressor):
    """k positions drawn from a generator seeded by (seed, step, layer): identical on every
    rank with no communication, so values alone are averaged by allreduce. Cheap to select,
    but blind to magnitude: it needs the residual to converge."""
    collective = "allreduce"

    def wire(self, layer: Layer) -> Wire:
        return Wire((torch.float32,), ("values",), (layer.k,), fixed=True)

    def _positions(self, layer: Layer, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((self.config.seed, step, layer.index)) & 0x7FFFFFFF)
        return torch.randperm(layer.numel, generator=gen)[:layer.k].to(layer.device)

    def compress(self, x, layer, step, first=None):
        idx = self._positions(layer, step)
        # the positions decode both this rank's message (for the residual) and the average
        return Message([x.index_select(0, idx)], ("values",), selected=idx.numel(), k=idx.numel(),
                       positions=idx, ctx=idx)

    def decompress_add(self, out, tensors, layer, alpha=1.0, ctx=None):
        out.index_add_(0, ctx, tensors[0].to(out), alpha=alpha)
