"""Experiment configuration: one schema, one name per knob, in YAML, CLI and Python.

A run is described by a YAML file with the sections ``model``, ``data``,
``optimizer``, ``training``, ``compression`` and ``output``. A file may start
with ``base: other.yaml`` (path relative to the file): the base is loaded first
and this file's keys override it, section by section, like DGC's configs.
Command-line overrides use the same dotted names: ``--set compression.density=0.01``.

Validation happens here, before any collective starts: unknown keys and bad
values raise :class:`ConfigError` naming the field and the fix.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, field_validator

from .compression import SHORTHANDS, MethodConfig, expand_shorthands, parse_compression


class ConfigError(ValueError):
    """A configuration problem, with the field and the fix in the message."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    # the names of redsync_hvd.models.MODEL_NAMES (a test keeps the two lists equal)
    name: Literal["mlp", "cnn", "resnet20", "vgg", "lstm_lm"] = Field("cnn", description="mlp | cnn | resnet20 | "
                                                                                       "vgg | lstm_lm")
    options: dict[str, Any] = Field(default_factory=dict, description="model-specific kwargs")


class DataConfig(_Section):
    # the names of redsync_hvd.data.DATASET_NAMES (a test keeps the two lists equal)
    name: Literal["digits", "synthetic", "synthetic_lm", "cifar10", "mnist", "ptb"] = Field(
        "digits", description="digits | synthetic | synthetic_lm | cifar10 | mnist | ptb")
    path: Optional[str] = Field(None, description="folder holding the dataset files (cifar10, mnist, ptb)")
    options: dict[str, Any] = Field(default_factory=dict, description="dataset-specific kwargs")


class ScheduleConfig(_Section):
    type: Literal["constant", "step", "cosine"] = Field("constant", description="constant | step | cosine")
    milestones: list[int] = Field(default_factory=list, description="epochs at which lr *= gamma (step)")
    gamma: float = Field(0.1, gt=0, description="step: lr factor at each milestone")
    warmup_epochs: float = Field(0.0, ge=0, description="linear lr warm-up from 0")


class OptimizerConfig(_Section):
    name: Literal["sgd", "adam"] = Field("sgd", description="sgd | adam (the wrapped optimizer)")
    lr: float = Field(0.1, gt=0, description="learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum; with compression.momentum_correction "
                                                          "it moves into the compression wrapper")
    nesterov: bool = Field(False, description="Nesterov momentum")
    weight_decay: float = Field(0.0, ge=0, description="L2 weight decay")
    scale_lr_by_workers: bool = Field(False, description="multiply lr by the number of workers")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)


class TrainingConfig(_Section):
    epochs: Optional[float] = Field(10, gt=0, description="epochs over this rank's shard")
    steps: Optional[int] = Field(None, gt=0, description="if set, stop after this many steps (overrides epochs)")
    batch_size: int = Field(32, gt=0, description="per-worker batch size")
    seed: int = Field(0, description="seeds model init, data split/shards and shuffling")
    eval_every: int = Field(0, ge=0, description="evaluate every N steps (0: at the end of each epoch)")
    log_every: int = Field(10, gt=0, description="write a metrics.jsonl line every N steps")
    checkpoint_every: int = Field(0, ge=0, description="save a checkpoint every N steps (0: only at the end)")
    resume: Optional[str] = Field(None, description="checkpoint file to resume from")
    progress: bool = Field(True, description="tqdm progress bar on rank 0")
    threads: Optional[int] = Field(None, gt=0, description="torch threads per worker (default: cores / local workers)")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="fp32 | bf16 | fp16: forward and backward under torch.autocast in that type; fp16 "
                            "adds a GradScaler. Parameters, residuals and the update stay fp32 (framework: torch)")


class OutputConfig(_Section):
    dir: str = Field("runs", description="parent folder of run folders")
    name: Optional[str] = Field(None, description="run folder name; default <config stem>")


class RunConfig(_Section):
    framework: Literal["torch", "tensorflow"] = Field("torch", description="torch | tensorflow (digits mlp/cnn; "
                                                                          "docs/tensorflow.md)")
    engine: Literal["horovod", "ddp"] = Field(
        "horovod", description="horovod (launch with horovodrun) | ddp (torch.distributed: launch with torchrun; "
                               "Gloo on CPU, NCCL on CUDA; docs/ddp.md)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    compression: SerializeAsAny[MethodConfig] = Field(default_factory=lambda: parse_compression({"method": "none"}))
    output: OutputConfig = Field(default_factory=OutputConfig)

    @field_validator("compression", mode="before")
    @classmethod
    def _compression(cls, value: Any) -> Any:
        return parse_compression(value) if isinstance(value, dict) else value

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def fingerprint(self) -> str:
        """Hash of the resolved config: ranks compare it to prove they agree."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# ---------------------------------------------------------------------------
def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if key == "compression" and isinstance(value, dict) and isinstance(out.get(key), dict):
            # ``selection: tbs`` in one file and ``selection: {scope: bucket}`` in the other merge
            out[key], value = expand_shorthands(out[key]), expand_shorthands(value)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            # A new compression method replaces the section: knobs of the old method would be unknown.
            if key == "compression" and "method" in value and value["method"] != out[key].get("method"):
                out[key] = copy.deepcopy(value)
            else:
                out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: Path, seen: tuple = ()) -> dict:
    """A YAML mapping; ``base: other.yaml`` (relative to it) is loaded first and deep-merged under it.
    Also used by the benchmark configs."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}. Pass an existing YAML file, e.g. configs/digits/dense.yaml")
    if path.resolve() in seen:
        raise ConfigError(f"config 'base' chain loops back to {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model, data, ...), got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    parent = read_yaml((path.parent / base).resolve(), seen + (path.resolve(),))
    return _deep_merge(parent, raw)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a","b","c"], value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like section.key=value, e.g. compression.density=0.01")
    key, _, text = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override '{item}' has an empty key")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{item}': cannot parse value: {exc}") from exc
    return parts, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = copy.deepcopy(raw)
    if isinstance(raw.get("compression"), dict):
        raw["compression"] = expand_shorthands(raw["compression"])   # --set compression.selection.scope=...
    for item in overrides or []:
        parts, value = parse_override(item)
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is not a section")
        if parts == ["compression", "method"] and node.get("method") != value:
            # switching method on the CLI drops the old method's knobs
            node.clear()
        if parts[:1] == ["compression"] and len(parts) == 2 and isinstance(value, str) \
                and isinstance(node.get(parts[1]), dict) and parts[1] in SHORTHANDS:
            node[parts[1]][SHORTHANDS[parts[1]]] = value   # --set compression.selection=trimmed keeps the group
            continue
        node[parts[-1]] = value
    return raw


def _format_errors(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown key. Check the spelling; valid keys are listed in docs/configuration.md")
        elif err["type"] == "value_error" and loc == "compression":   # parse_compression's own message
            lines.append(f"  {err['ctx']['error']}")
        else:
            lines.append(f"  {loc}: {err['msg']} (got {err.get('input')!r})")
    return f"invalid configuration in {source}:\n" + "\n".join(lines)


def validate(raw: dict, source: str = "<dict>") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
    except ValueError as exc:  # raised by parse_compression with its own message
        raise ConfigError(f"invalid configuration in {source}: {exc}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    raw = read_yaml(Path(path)) if path else {}
    raw = apply_overrides(raw, overrides or [])
    cfg = validate(raw, str(path or "<defaults>"))
    if cfg.output.name is None and path:
        cfg.output.name = Path(path).stem
    return cfg
