"""Schema of the ``compression:`` section, one small model per method.

Each method registers its knobs here with :func:`register_method`; the same
names are used in YAML, on the CLI (``--set compression.<knob>=...``) and in the
Python dict passed to ``DistributedOptimizer(compression=...)``.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_METHODS: dict[str, type["CompressionConfig"]] = {}


def register_method(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        _METHODS[name] = cls
        return cls
    return deco


def method_names() -> list[str]:
    return sorted(_METHODS)


def check_density(value: float, field: str = "density") -> float:
    if not (0.0 < float(value) <= 1.0):
        raise ValueError(
            f"{field}={value!r} is outside (0, 1]: it is the fraction of each layer's "
            f"elements sent per step (e.g. 0.01 sends 1%; 1.0 sends everything)")
    return float(value)


class CompressionConfig(BaseModel):
    """Knobs every method shares."""
    model_config = ConfigDict(extra="forbid")
    method: str
    check_finite: bool = Field(
        True, description="stop with a clear error on NaN/Inf gradients (all ranks agree, residuals untouched); "
                          "costs one reduction per layer and one tiny allreduce per step")
    fusion_bytes: int = Field(
        16 << 20, gt=0, description="compressed layers are packed into buckets of at most this many dense bytes; "
                                    "one bucket = one allgather (fewer collectives, later start)")
    min_compress_numel: int = Field(
        0, ge=0, description="layers with fewer elements go dense through Horovod's fused allreduce")

    # filled by subclasses that compress
    uses_memory: ClassVar[bool] = False


@register_method("none")
class NoneConfig(CompressionConfig):
    """Dense fp32 allreduce (Horovod's default): the baseline everything is compared to."""


@register_method("fp16")
class FP16Config(CompressionConfig):
    """Dense allreduce in half precision: 2x fewer bytes, no residual."""


class _SparseConfig(CompressionConfig):
    density: float = Field(0.01, description="fraction of each layer's elements sent per step, in (0, 1]")
    residual: bool = Field(True, description="keep what is not sent and add it to the next gradient (error feedback)")

    @field_validator("density")
    @classmethod
    def _density(cls, v: float) -> float:
        return check_density(v)

    @property
    def uses_memory(self) -> bool:  # type: ignore[override]
        return self.residual


class _AllgatherSparseConfig(_SparseConfig):
    """Methods whose compressed layers travel as (positions, values) by allgather."""
    sparse_update: bool = Field(
        False, description="PyTorch, plain SGD only: apply each compressed layer's averaged sparse gradient "
                           "straight to its weights inside step(), instead of writing a dense .grad that "
                           "is almost all zeros and updating every weight. Saves two passes over the "
                           "compressed layers per step (worth it on CPUs; a GPU does those passes in "
                           "microseconds). Those parameters' .grad is None after step(); call "
                           "synchronize() first to see dense averaged gradients (e.g. to clip them). "
                           "Needs torch.optim.SGD without momentum and weight decay in the optimizer "
                           "(momentum_correction takes both out)")


@register_method("topk")
class TopKConfig(_AllgatherSparseConfig):
    """Exact top-k by magnitude (torch.topk), sent as (int32 index, fp32 value) pairs over allgather."""


@register_method("randomk")
class RandomKConfig(_SparseConfig):
    """k random positions drawn from a seed shared by all ranks, so only values travel, by allreduce."""
    seed: int = Field(0, description="shared seed; the positions change every step")


def parse_compression(value: Any) -> CompressionConfig:
    """dict (YAML section) or config object -> validated config object."""
    if isinstance(value, CompressionConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"compression must be a mapping like {{'method': 'topk', 'density': 0.01}}, got {value!r}")
    method = value.get("method", "none")
    if method not in _METHODS:
        raise ValueError(f"compression.method={method!r} is unknown; choose one of {method_names()}")
    try:
        return _METHODS[method].model_validate({**value, "method": method})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = "compression." + ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                valid = sorted(_METHODS[method].model_fields)
                problems.append(f"{loc}: unknown key for method {method!r}; valid keys: {valid}")
            else:
                problems.append(f"{loc}: {err['msg']}")
        raise ValueError("; ".join(problems)) from None


class LayerOverride(BaseModel):
    """Per-layer settings by parameter-name pattern (fnmatch, e.g. ``"embedding.*"``, ``"*fc*.weight"``).
    The first matching entry wins."""
    model_config = ConfigDict(extra="forbid")
    pattern: str
    density: float | None = None
    selection: str | None = None
    dense: bool = Field(False, description="send this layer dense (fused allreduce)")

    @field_validator("density")
    @classmethod
    def _density(cls, v):
        return None if v is None else check_density(v, "layers[].density")


@register_method("redsync")
class RedSyncConfig(_AllgatherSparseConfig):
    """RedSync: residual gradient compression with fast selection and quantised messages.
    See docs/redsync.md for each knob's trade-off."""
    density: float = Field(0.001, description="fraction of each compressed layer sent per step, in (0, 1]")
    selection: str = Field("tbs", description="exact | trimmed | tbs | sampled")
    tbs_max_probes: int = Field(20, gt=0, description="tbs: probe budget before the exact fallback")
    trimmed_eps: float = Field(0.2, gt=0, lt=1, description="trimmed: step of the threshold ratio")
    sample_fraction: float = Field(0.01, gt=0, le=1, description="sampled: fraction of elements sampled")
    threshold_reuse: int = Field(1, ge=1, description="re-search a layer's threshold every R steps "
                                                      "(or when the count leaves [k/2, 2k]); else only count")
    selection_scope: str = Field(
        "auto", description="layer: select each layer in its gradient hook (per-layer searches, threshold "
                            "reuse; fastest on CPUs) | bucket: select all compressed layers of a bucket at "
                            "once when its last gradient arrives, by histogram thresholds, with one host "
                            "wait per bucket instead of several per layer (for GPUs; tbs only, "
                            "threshold_reuse does not apply) | auto: bucket on CUDA with selection tbs "
                            "and no per-layer selection overrides, else layer")
    quantize: str = Field("sign_mean", description="none | fp16 | sign_mean")
    sign_rule: str = Field("alternate", description="sign_mean: alternate (RedSync) | larger (SBC)")
    index_coding: str = Field("raw", description="raw (int32) | golomb (Golomb-Rice coded gaps)")
    min_compress_numel: int = Field(4096, ge=0, description="smaller layers go dense (fused allreduce)")
    momentum_correction: bool = Field(True, description="DGC: accumulate velocity, not gradient, in the "
                                                        "residual; takes momentum out of the base optimizer")
    momentum_masking: bool = Field(True, description="DGC: zero the velocity where values were sent")
    clip_norm: float | None = Field(None, gt=0, description="local per-layer gradient clipping at "
                                                            "clip_norm * N**-0.5 before accumulation")
    warmup_epochs: float = Field(0.0, ge=0, description="DGC density warm-up length in epochs")
    warmup_steps: int = Field(0, ge=0, description="... or in steps (takes precedence when > 0)")
    warmup_start_density: float = Field(0.25, description="density at the start of warm-up")
    warmup_stages: int = Field(4, ge=1, description="exponential decay in this many equal stages")
    layers: list[LayerOverride] = Field(default_factory=list, description="per-layer overrides")
    policy: str = Field("static", description="static | cost_model")
    latency_s: float | None = Field(None, ge=0, description="cost_model: link latency (None: probe)")
    bandwidth_gbit: float | None = Field(None, gt=0, description="cost_model: bandwidth (None: probe)")

    uses_memory: ClassVar[bool] = True

    @field_validator("selection")
    @classmethod
    def _selection(cls, v):
        return _choice(v, "selection", ("exact", "trimmed", "tbs", "sampled"))

    @field_validator("quantize")
    @classmethod
    def _quantize(cls, v):
        return _choice(v, "quantize", ("none", "fp16", "sign_mean"))

    @field_validator("selection_scope")
    @classmethod
    def _scope(cls, v):
        return _choice(v, "selection_scope", ("auto", "layer", "bucket"))

    @model_validator(mode="after")
    def _bucket_scope_is_tbs(self):
        if self.selection_scope == "bucket" and (self.selection != "tbs"
                                                 or any(o.selection for o in self.layers)):
            raise ValueError("selection_scope=bucket selects by histogram thresholds, which is tbs "
                             "(k to 2k elements per layer): set selection: tbs and drop per-layer "
                             "selection overrides, or use selection_scope: layer")
        return self

    @field_validator("sign_rule")
    @classmethod
    def _sign_rule(cls, v):
        return _choice(v, "sign_rule", ("alternate", "larger"))

    @field_validator("index_coding")
    @classmethod
    def _coding(cls, v):
        return _choice(v, "index_coding", ("raw", "golomb"))

    @field_validator("policy")
    @classmethod
    def _policy(cls, v):
        return _choice(v, "policy", ("static", "cost_model"))

    @field_validator("warmup_start_density")
    @classmethod
    def _wsd(cls, v):
        return check_density(v, "warmup_start_density")

    @field_validator("layers")
    @classmethod
    def _layers(cls, v):
        return _layer_selections(v, ("exact", "trimmed", "tbs", "sampled"))


def _choice(value: str, field: str, choices: tuple) -> str:
    if value not in choices:
        raise ValueError(f"{field}={value!r} is not one of {list(choices)}")
    return value


def _layer_selections(overrides: list, choices: tuple) -> list:
    for o in overrides:
        if o.selection is not None:
            _choice(o.selection, "layers[].selection", choices)
    return overrides


@register_method("iwp")
class IWPConfig(_SparseConfig):
    """Importance-weighted pruning (Cheng & Xu): a leader picks the top |residual|/(|w|+eps)
    positions, broadcasts them, and every rank's values there are summed by one plain allreduce."""
    density: float = Field(0.01, description="fraction of each compressed layer sent per step, in (0, 1]")
    seed: int = Field(0, description="shared seed of the per-step leader draw (no communication to agree)")
    eps: float = Field(1e-8, gt=0, description="importance = |residual| / (|weight| + eps)")
    selection: str = Field("trimmed", description="exact | trimmed (exactly k indices are needed)")
    min_compress_numel: int = Field(4096, ge=0, description="smaller layers go dense (fused allreduce)")
    layers: list[LayerOverride] = Field(default_factory=list, description="per-layer overrides")

    uses_memory: ClassVar[bool] = True

    @field_validator("selection")
    @classmethod
    def _selection(cls, v):
        return _choice(v, "selection", ("exact", "trimmed"))

    @field_validator("layers")
    @classmethod
    def _layers(cls, v):
        return _layer_selections(v, ("exact", "trimmed"))


@register_method("sbc")
class SBCConfig(_SparseConfig):
    """Sparse Binary Compression (Sattler et al.): n local steps, then the accumulated model
    delta plus residual is sparsified, binarised (one mean, one sign) and its positions
    Golomb-coded; every rank decodes all messages and applies their average."""
    density: float = Field(0.01, description="fraction of each layer's delta sent per round, in (0, 1]")
    local_steps: int = Field(10, ge=1, description="optimizer steps between communications (1: per-step "
                                                   "gradient compression)")
    binarize: bool = Field(True, description="send one mean for the side (top-k positive or top-k negative) "
                                             "with the larger mean magnitude; false: send k values")
    index_coding: str = Field("golomb", description="golomb (Golomb-Rice coded gaps) | raw (int32)")
    layers: list[LayerOverride] = Field(default_factory=list, description="per-layer overrides (density, dense)")

    uses_memory: ClassVar[bool] = True

    @field_validator("layers")
    @classmethod
    def _layers(cls, v):
        for o in v:
            if o.selection is not None:
                raise ValueError(f"layers[].selection={o.selection!r}: sbc picks each sign's top-k exactly "
                                 "(torch.topk); remove selection from the override")
        return v

    @field_validator("index_coding")
    @classmethod
    def _coding(cls, v):
        return _choice(v, "index_coding", ("raw", "golomb"))

    @property
    def quantize(self) -> str:
        return "sign_mean" if self.binarize else "none"


class DecentralizedConfig(CompressionConfig):
    """Decentralized training (Tang et al. 2018), no allreduce: each worker mixes models with its
    neighbours (ring by default) through mpi4py. dcd: compressed differences (minmax); ecd:
    compressed extrapolations (grid); dpsgd: uncompressed D-PSGD; naive: compressed models (fails)."""
    bits: int = Field(8, description="8 | 4 | 2 bits per element (minmax, grid)")
    quantizer: str = Field("minmax", description="minmax (relative error: dcd, naive) | grid (absolute error: "
                                                 "ecd) | topk | none")
    step: float = Field(0.01, gt=0, description="grid: spacing; beyond +-step*(2**(bits-1)-1) values are clipped")
    density: float = Field(0.1, description="topk: fraction of elements sent, in (0, 1]")
    unbiased: bool = Field(True, description="topk: random-k scaled by n/k (unbiased) or plain top-k (biased)")
    topology: Any = Field("ring", description="ring | N x N mixing matrix (list of lists) | path to a YAML file")
    seed: int = Field(0, description="seed of the stochastic rounding (combined with the rank)")

    @field_validator("bits")
    @classmethod
    def _bits(cls, v):
        if v not in (8, 4, 2):
            raise ValueError(f"bits={v!r} is not one of [8, 4, 2]")
        return v

    @field_validator("quantizer")
    @classmethod
    def _quantizer(cls, v):
        return _choice(v, "quantizer", ("minmax", "grid", "topk", "none"))

    @field_validator("density")
    @classmethod
    def _density(cls, v):
        return check_density(v)


DECENTRALIZED = ("dcd", "ecd", "dpsgd", "naive")
for _name in DECENTRALIZED:
    register_method(_name)(DecentralizedConfig)
