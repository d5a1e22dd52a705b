"""Layer-wise policy: which layers are compressed, and at what density, per step.

Small layers (biases, norms) cost more in latency and selection than they save
in bytes, so below ``min_compress_numel`` they go dense through Horovod's fused
allreduce. Later methods add per-layer overrides, warm-up and a cost model here.
"""
from __future__ import annotations

from .compressors.base import Layer


class LayerPolicy:
    def __init__(self, config):
        self.config = config

    def is_compressed(self, layer: Layer) -> bool:
        return layer.numel >= self.config.min_compress_numel

    def density(self, layer: Layer, step: int) -> float:
        return getattr(self.config, "density", 1.0) if layer.compressed else 1.0

    def describe(self, layers: list) -> list[dict]:
        return [{"name": l.name, "numel": l.numel, "compressed": l.compressed} for l in layers]
