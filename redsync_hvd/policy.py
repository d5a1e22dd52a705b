"""Layer-wise policy: which layers are compressed, with which selection, at what density, per step.

* Small layers (biases, norms) cost more in latency and selection than they save
  in bytes: below ``min_compress_numel`` they go dense through Horovod's fused allreduce.
* ``layers:`` overrides match parameter names (fnmatch); the first match wins.
* Warm-up (DGC): density decays exponentially from ``warmup_start_density`` to
  ``density`` in ``warmup_stages`` equal stages over ``warmup_steps`` (or
  ``warmup_epochs``), e.g. 25%, 6.25%, 1.56%, 0.4%, then 0.1%.
* ``policy: cost_model`` compresses a layer only when the alpha-beta model predicts
  select + allgather + decompress below its share of the fused dense allreduce (the
  bandwidth term: Horovod fuses dense layers, so they share one latency; see costmodel.py).
"""
from __future__ import annotations

import fnmatch
import math

from .compressors.base import Layer


class LayerPolicy:
    def __init__(self, config):
        self.config = config
        self.steps_per_epoch: int | None = None
        self.decisions: list[dict] = []
        self.compute = None   # costmodel.ComputeModel; None: the model's default figures

    def _override(self, name: str):
        for o in getattr(self.config, "layers", []) or []:
            if fnmatch.fnmatchcase(name, o.pattern):
                return o
        return None

    def setup(self, layers: list, size: int = 1, network=None) -> None:
        """Decide once, before the first step, how each layer travels."""
        base = getattr(self.config, "density", 1.0)
        for layer in layers:
            o = self._override(layer.name)
            layer.base_density = (o.density if o is not None and o.density is not None else base)
            layer.selection = o.selection if o is not None else None
            reason = "compressed"
            if o is not None and o.dense:
                layer.compressed, reason = False, f"dense by layers[{o.pattern!r}]"
            elif layer.numel < self.config.min_compress_numel:
                layer.compressed, reason = False, f"numel {layer.numel} < min_compress_numel"
            else:
                layer.compressed = True
                if getattr(self.config, "policy", "static") == "cost_model" and network is not None:
                    from .costmodel import fused_dense_share, predict_layer
                    pred = predict_layer(layer.numel, layer.base_density, size, network, self._cost_method(),
                                         compute=self.compute)
                    # a dense layer rides in Horovod's fusion buffer: its marginal cost is the
                    # bandwidth term, the latency is paid once for all of them
                    dense = fused_dense_share(layer.numel, size, network)
                    layer.compressed = pred.total_s < dense
                    reason = (f"cost model: compressed {pred.total_s * 1e3:.3f} ms (select "
                              f"{pred.select_s * 1e3:.3f}) vs its share of the fused dense allreduce "
                              f"{dense * 1e3:.3f} ms")
            self.decisions.append({"name": layer.name, "numel": layer.numel, "compressed": layer.compressed,
                                   "density": layer.base_density if layer.compressed else 1.0, "why": reason})

    def _cost_method(self) -> str:
        c = self.config
        if getattr(c, "index_coding", "raw") == "golomb":
            return "golomb"
        return {"sign_mean": "sign_mean", "fp16": "pairs_fp16"}.get(getattr(c, "quantize", "none"), "pairs")

    def warmup_steps(self) -> int:
        c = self.config
        if getattr(c, "warmup_steps", 0):
            return c.warmup_steps
        if getattr(c, "warmup_epochs", 0):
            if not self.steps_per_epoch:
                raise ValueError("compression.warmup_epochs needs the number of steps per epoch: call "
                                 "optimizer.set_steps_per_epoch(len(train_loader)), or use warmup_steps")
            return int(round(c.warmup_epochs * self.steps_per_epoch))
        return 0

    def density(self, layer: Layer, step: int) -> float:
        if not layer.compressed:
            return 1.0
        final = getattr(layer, "base_density", getattr(self.config, "density", 1.0))
        total = self.warmup_steps()
        if not total or step >= total:
            return final
        start = max(self.config.warmup_start_density, final)
        stages = self.config.warmup_stages
        frac = math.floor(step / total * stages) / stages
        return start * (final / start) ** frac
