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
    name: Literal["digits", "synthetic", "synthetic_lm", "cifar10", "mnist", "ptb", "pydoc"] = Field(
        "digits", description="digits | synthetic | synthetic_lm | cifar10 | mnist | ptb | pydoc (the Python "
                              "reference text of pydoc_data.topics: real English, no download; "
                              "redsync_hvd/data/pydoc.py)")
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
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum; with compression.dgc.momentum_correction "
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
    checkpoint_every: int = Field(0, ge=0, description="save a checkpoint every N steps, kept as checkpoint-step<N>"
                                                       "-rank<r>.pt (0: none; the last step is always saved)")
    checkpoint_every_s: float = Field(600.0, ge=0, description="also save every this many seconds of wall time, "
                                                               "at a step all ranks agree on (0: never)")
    resume: Optional[str] = Field(None, description="continue from a run folder (its latest checkpoints), or a "
                                                    "checkpoint file with {rank} in its name")
    on_resize: Literal["error", "sum", "reset"] = Field(
        "error", description="resuming on another number of workers: error | sum (old rank i's residual goes "
                             "to new rank i % N) | reset (residuals dropped and counted); docs/reliability.md")
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
    engine: Literal["horovod", "ddp", "fsdp"] = Field(
        "horovod", description="horovod (launch with horovodrun) | ddp (torch.distributed: launch with torchrun; "
                               "Gloo on CPU, NCCL on CUDA; docs/ddp.md) | fsdp (FSDP2's sharded training under "
                               "torchrun, compressed through its reduce-scatter: none, topk, redsync; docs/fsdp.md)")
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

    def experiment(self) -> dict:
        """The config without what a resume may change (:data:`RESUMABLE`): what a checkpoint's
        state depends on."""
        out = self.to_dict()
        for dotted in RESUMABLE:
            section, _, key = dotted.partition(".")
            if key:
                out.get(section, {}).pop(key, None)
            else:
                out.pop(section, None)
        return out

    def experiment_fingerprint(self) -> str:
        """Hash of :meth:`experiment`: checkpoints resume only into a run with the same one."""
        blob = json.dumps(self.experiment(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# What a resumed run may set differently from the run that wrote the checkpoints: where it
# writes, how often it logs, evaluates and saves, how long it trains, what a resize does.
RESUMABLE = ("output", "training.resume", "training.on_resize", "training.checkpoint_every",
             "training.checkpoint_every_s", "training.progress", "training.threads", "training.log_every",
             "training.eval_every", "training.epochs", "training.steps")


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
        what = "is a folder, not a YAML file" if path.is_dir() else "not found"
        raise ConfigError(f"config {what}: {path}. Pass an existing YAML file, e.g. configs/digits/dense.yaml")
    if path.resolve() in seen:
        raise ConfigError(f"config 'base' chain loops back to {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(exc)}. Fix that line (indent with spaces, "
                          "close brackets and quotes)") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"cannot read {path} as a YAML text file: {exc}") from None
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
        raise ConfigError(f"override '{item}': its value is not valid YAML ({yaml_problem(exc, line=False)}). "
                          f"Complete it, or quote it to pass a plain string: --set '{key}=\"{text}\"'") from None
    return parts, value


def yaml_problem(exc: yaml.YAMLError, line: bool = True) -> str:
    """One line out of PyYAML's multi-line report: what is wrong and where."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return problem
    where = f"line {mark.line + 1}, column {mark.column + 1}" if line else f"column {mark.column + 1}"
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and line:
        context += f" that starts at line {start.line + 1}, column {start.column + 1}"
    return f"{problem} at {where}" + (f" ({context})" if context else "")


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
        elif err["type"] == "literal_error":
            choices = err["ctx"]["expected"].replace("'", "").replace(" or ", ", ")
            lines.append(f"  {loc}: {err.get('input')!r} is not one of: {choices}")
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
