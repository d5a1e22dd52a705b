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
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from .compression import SHORTHANDS, MethodConfig, expand_shorthands, parse_compression
from .errors import DEFAULTS, Sources, describe, shown


class ConfigError(ValueError):
    """A configuration problem, with the field and the fix in the message."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


# what a language model reads (token ids), by name; every other model and dataset is images
LM_MODELS = ("lstm_lm", "gpt")
LM_DATASETS = ("synthetic_lm", "ptb", "pydoc", "austen")


class ModelConfig(_Section):
    # the names of redsync_hvd.models.MODEL_NAMES (a test keeps the two lists equal)
    name: Literal["mlp", "cnn", "resnet20", "vgg", "lstm_lm", "gpt"] = Field(
        "cnn", description="mlp | cnn | resnet20 | vgg | lstm_lm | gpt (a decoder-only transformer LM; "
                           "redsync_hvd/models/gpt.py)")
    options: dict[str, Any] = Field(default_factory=dict, description="model-specific kwargs")


class DataConfig(_Section):
    # the names of redsync_hvd.data.DATASET_NAMES (a test keeps the two lists equal)
    name: Literal["digits", "synthetic", "synthetic_lm", "cifar10", "mnist", "fashion_mnist", "ptb", "pydoc",
                  "austen"] = Field(
        "digits", description="digits | synthetic | synthetic_lm | cifar10 | mnist | fashion_mnist (Debian's "
                              "dataset-fashion-mnist) | ptb | pydoc (the Python reference text of "
                              "pydoc_data.topics: real English, no download; redsync_hvd/data/pydoc.py) | austen "
                              "(Jane Austen's novels, from Debian's r-cran-janeaustenr; docs/data.md)")
    path: Optional[str] = Field(None, description="folder holding the dataset files (cifar10, mnist, ptb; "
                                                  "fashion_mnist and austen: where Debian's packages put them "
                                                  "unless set, docs/data.md)")
    options: dict[str, Any] = Field(default_factory=dict, description="dataset-specific kwargs")


class ScheduleConfig(_Section):
    type: Literal["constant", "step", "cosine"] = Field("constant", description="constant | step | cosine")
    milestones: list[int] = Field(default_factory=list, description="epochs at which lr *= gamma (step)")
    gamma: float = Field(0.1, gt=0, description="step: lr factor at each milestone")
    warmup_epochs: float = Field(0.0, ge=0, description="linear lr warm-up from 0, in epochs; the warm-up "
                                                        "multiplies the schedule's factor")
    warmup_steps: int = Field(0, ge=0, description="... or in steps (one of warmup_epochs, warmup_steps, "
                                                   "warmup_fraction)")
    warmup_fraction: float = Field(0.0, ge=0, lt=1, description="... or as a share of the run's steps (e.g. 0.05)")
    min_lr_factor: float = Field(0.0, ge=0, le=1, description="cosine: the factor it decays to (the floor: lr "
                                                              "ends at min_lr_factor * lr)")

    @model_validator(mode="after")
    def _one_warmup(self):
        given = [k for k in ("warmup_epochs", "warmup_steps", "warmup_fraction") if getattr(self, k)]
        if len(given) > 1:
            raise ValueError(f"schedule sets {' and '.join(given)}: give the warm-up's length once (keep one, "
                             "set the others to 0)")
        if self.min_lr_factor and self.type != "cosine":
            raise ValueError(f"schedule.min_lr_factor is the floor of the cosine decay, but schedule.type is "
                             f"{self.type!r}: set type: cosine, or drop min_lr_factor")
        return self


class OptimizerConfig(_Section):
    name: Literal["sgd", "adam", "adamw"] = Field(
        "sgd", description="sgd | adam | adamw (the wrapped optimizer; adamw: torch.optim.AdamW, decoupled "
                           "weight decay, Loshchilov and Hutter 2019)")
    lr: float = Field(0.1, gt=0, description="learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum; with compression.dgc.momentum_correction "
                                                          "it moves into the compression wrapper")
    nesterov: bool = Field(False, description="Nesterov momentum")
    weight_decay: float = Field(0.0, ge=0, description="sgd, adam: L2 weight decay (wd * w added to the gradient); "
                                                       "adamw: decoupled (w -= lr * wd * w, beside Adam's step)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="adam, adamw: the moments' decay rates, torch's "
                                                                 "defaults (GPT recipes often take [0.9, 0.95])")
    eps: float = Field(1e-8, gt=0, description="adam, adamw: added to the second moment's root (torch's default)")
    no_decay: list[Literal["bias", "norm", "embedding"]] = Field(
        default_factory=list, description="parameters without weight decay, chosen by module type (framework: "
                                          "torch): bias (every module's bias) | norm (LayerNorm, BatchNorm, "
                                          "GroupNorm, RMSNorm weights) | embedding (nn.Embedding weights, tied "
                                          "output layers included); the usual GPT recipe is all three")
    scale_lr_by_workers: bool = Field(False, description="multiply lr by the number of workers")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple) -> tuple:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas {list(v)} must each be in [0, 1), e.g. [0.9, 0.999]")
        return v


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
    overwrite: bool = Field(False, description="a run folder that holds another run's files: delete them (config, "
                                               "metrics, summary, decisions, layers.log and every rank's checkpoints) "
                                               "and start afresh; false: stop before training with the ways on "
                                               "(resume that run, another output.name, or this)")


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
        out["compression"] = settled(out["compression"], self.compression)
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


def settled(compression: dict, config: MethodConfig) -> dict:
    """The ``auto`` settings of ``compression`` (a dumped section) as a run's state depends on them,
    which is how checkpoints written before they were ``auto`` recorded them: the threshold reuse
    as the number it became, ``sparse_update`` false where it cannot turn on (any policy but the
    cost model's). A run whose ``auto`` chose differently stays another experiment."""
    out = dict(compression)
    selection = getattr(config, "selection", None)
    if isinstance(out.get("selection"), dict) and hasattr(selection, "threshold_reuse"):
        out["selection"] = {**out["selection"], "threshold_reuse": selection.threshold_reuse}
    if out.get("sparse_update") == "auto" and not getattr(config, "may_update_in_step", False):
        out["sparse_update"] = False
    return out


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


def read_yaml(path: Path, seen: tuple = (), sources: Sources | None = None, referrer: str | None = None) -> dict:
    """A YAML mapping; ``base: other.yaml`` (relative to it) is loaded first and deep-merged under it.
    ``sources`` records which file gave each key; ``referrer``: the file whose ``base:`` this is.
    Also used by the benchmark configs."""
    origin = shown(path) if referrer is None else f"{shown(path)} (the base: of {referrer})"
    if not path.is_file():
        what = "is a folder, not a YAML file" if path.is_dir() else "not found"
        if referrer is not None:
            raise ConfigError(f"{referrer}: its base: file {what}: {shown(path)}. Point base: at an existing YAML "
                              f"file (a path relative to {referrer})")
        raise ConfigError(f"config {what}: {path}. Pass an existing YAML file, e.g. configs/digits/dense.yaml")
    if path.resolve() in seen:
        raise ConfigError(f"config 'base' chain loops back to {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin} is not valid YAML: {yaml_problem(exc)}. Fix that line (indent with spaces, "
                          "close brackets and quotes)") from None
    except (UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"cannot read {origin} as a YAML text file: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin} must hold a mapping of sections (model, data, ...), got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        if sources is not None:
            sources.record(raw, origin)
        return raw
    parent = read_yaml((path.parent / base).resolve(), seen + (path.resolve(),), sources, shown(path))
    if sources is not None:
        sources.record(raw, origin)
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


def apply_overrides(raw: dict, overrides: list[str], sources: Sources | None = None) -> dict:
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
        else:
            node[parts[-1]] = value
        if sources is not None:
            sources.set(parts, value, f"--set {item}")
    return raw


def validate(raw: dict, source: str = "<dict>", sources: Sources | None = None) -> RunConfig:
    """``raw`` as a RunConfig, or ConfigError: one line that names where each bad value came from
    (``sources``, else ``source``), what is wrong and the fix."""
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe(exc, RunConfig, sources, source)) from None
    except ValueError as exc:  # raised by parse_compression with its own message
        raise ConfigError(f"invalid configuration in {source}: {exc}") from None
    problem = task_problem(cfg)
    if problem:
        places = dict.fromkeys(sources.origin(k) if sources is not None else source
                               for k in (("model", "name"), ("data", "name")))
        raise ConfigError(f"invalid configuration in {' and '.join(p if p != DEFAULTS else source for p in places)}: "
                          f"{problem}")
    return cfg


def task_problem(cfg: RunConfig) -> str | None:
    """A language model on images, or an image model on tokens: what to change (None: they fit)."""
    model, data = cfg.model.name, cfg.data.name
    if (model in LM_MODELS) == (data in LM_DATASETS):
        return None
    images = [n for n in DataConfig.model_fields["name"].annotation.__args__ if n not in LM_DATASETS]
    image_models = [n for n in ModelConfig.model_fields["name"].annotation.__args__ if n not in LM_MODELS]
    if model in LM_MODELS:
        return (f"model.name: {model!r} is a language model (it reads token ids), but data.name: {data!r} holds "
                f"images. Train it on {', '.join(sorted(LM_DATASETS))}, or pick an image model for {data}: "
                f"{', '.join(image_models)}")
    return (f"model.name: {model!r} is an image model, but data.name: {data!r} holds token ids (a language model's "
            f"data). Use model.name: {', '.join(sorted(LM_MODELS))} with it, or an image dataset: {', '.join(images)}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                sources: Sources | None = None) -> RunConfig:
    """The config of ``path`` with ``overrides`` (``--set`` items); ``sources`` (if given) is
    filled with where each key came from, for later messages."""
    sources = Sources() if sources is None else sources
    raw = read_yaml(Path(path), sources=sources) if path else {}
    raw = apply_overrides(raw, overrides or [], sources)
    cfg = validate(raw, shown(path) if path else "<defaults>", sources)
    if cfg.output.name is None and path:
        cfg.output.name = Path(path).stem
    return cfg
