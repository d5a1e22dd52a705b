"""Schema of the ``compression:`` section, one small model per method.

Each method registers its knobs here with :func:`register_method`; the same
names are used in YAML, on the CLI (``--set compression.<knob>=...``) and in the
Python dict passed to ``DistributedOptimizer(compression=...)``.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


@register_method("topk")
class TopKConfig(_SparseConfig):
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
