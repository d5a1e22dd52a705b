"""Hard-threshold sparsification with error feedback (Sahu, Dutta, Abdelmoniem, Banerjee, Canini and
Kalnis, "Rethinking gradient sparsification as total error minimization", NeurIPS 2021).

Per layer, with x = g + e the gradient plus what was kept (the exchange's memory):

    send    every (i, x_i) with |x_i| > threshold      (position-value pairs, by allgather)
    keep    e = x - sent                               (the memory: decompress_add with alpha = -1)

The paper shows that one threshold for all layers and steps minimises the total error that error
feedback carries over training, where top-k fixes the count per step instead: a layer sends as
much as it has above the threshold, so the bytes per step follow the gradients. This file is the
whole method: its config (the YAML section ``compression: {method: threshold, threshold: ...}``)
and its compressor, and one line in ``config/registry.py`` names both (docs/extending.md).
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..config.compression import CompressionConfig
from .base import Compressor, Layer, Message, Wire


class ThresholdConfig(CompressionConfig):
    """Hard threshold with error feedback: every element whose magnitude exceeds ``threshold`` is sent
    as an (int32 position, fp32 value) pair by allgather; the rest waits in the residual."""
    method: Literal["threshold"] = "threshold"
    threshold: float = Field(
        0.01, gt=0, description="send |x| > threshold (x: gradient plus residual). Lower sends more elements "
                                "and keeps less error; the bytes per step follow the gradients' scale, so "
                                "set it from a dense run's gradient magnitudes")
    expected_density: float = Field(
        0.01, gt=0, le=1, description="the share of a layer the cost model assumes is sent before the first "
                                      "step has measured it (policy.mode: cost_model decides at start)")
    residual: bool = Field(True, description="error feedback: keep what was not sent and add it to the next "
                                             "gradient (without it, small gradients are never sent)")

    @property
    def uses_memory(self) -> bool:
        return self.residual


class ThresholdCompressor(Compressor):
    collective = "allgather"

    def __init__(self, config: ThresholdConfig, comm=None):
        super().__init__(config, comm)
        self.sent: dict = {}       # layer name -> (elements sent, steps): what wire() reports
        self._pending: dict = {}   # this step's counts, kept once it commits

    def wire(self, layer: Layer) -> Wire:
        """Position-value pairs, as many as this layer has sent per step on average so far."""
        total, steps = self.sent.get(layer.name, (layer.numel * self.config.expected_density, 1))
        k = total / steps
        return Wire((layer.index_dtype, torch.float32), ("indices", "values"), (k, k))

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        idx = torch.nonzero(x.abs() > self.config.threshold).reshape(-1)
        self._pending[layer.name] = idx.numel()
        return Message([idx.to(layer.index_dtype), x.index_select(0, idx)], ("indices", "values"),
                       selected=idx.numel(), k=idx.numel(), positions=idx)

    def decompress_add(self, out: torch.Tensor, tensors: list, layer: Layer, alpha: float = 1.0, ctx=None) -> None:
        idx, values = tensors
        if idx.numel():
            out.index_add_(0, idx.to(device=out.device, dtype=torch.int64), values.to(out), alpha=alpha)

    def commit(self) -> None:
        for name, n in self._pending.items():
            total, steps = self.sent.get(name, (0, 0))
            self.sent[name] = (total + n, steps + 1)
        self._pending = {}

    def rollback(self) -> None:
        self._pending = {}

    def state_dict(self) -> dict:
        return {"sent": dict(self.sent)}

    def load_state_dict(self, state: dict) -> None:
        self.sent = {n: tuple(v) for n, v in state.get("sent", {}).items()}
        self._pending = {}
