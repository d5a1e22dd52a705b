"""Schema of the ``compression:`` section: one typed model per method.

A knob has one name in YAML, on the CLI (``--set compression.selection.method=trimmed``) and in
the dict passed to ``DistributedOptimizer(compression=...)``. RedSync's knobs come in groups,
one per concern:

    selection   how about k elements are found (method, scope, search budgets, threshold reuse)
    message     what travels (quantisation, sign rule, index coding)
    dgc         Deep Gradient Compression's corrections (momentum correction, masking, clipping)
    warmup      the density warm-up schedule
    policy      which layers compress (size floor, per-layer overrides, cost model)

Each method declares what it can do as class variables (``strategy``, ``frameworks``,
``engines``, ``delayed``), so callers ask the config instead of probing for attributes.
``selection: tbs`` and ``policy: cost_model`` are short for ``{method: tbs}`` and
``{mode: cost_model}``. A key from before the grouping (``quantize``, ``selection_scope``, ...)
is refused with the name it moved to.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PrivateAttr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from . import registry
from .errors import closest, dotted, plain, relevant, unknown_key

Selection = Literal["exact", "trimmed", "tbs", "sampled"]          # per layer (core/select/searches.py)
SelectionMethod = Literal["exact", "trimmed", "tbs", "sampled", "radix"]   # radix: by bucket only

# flat keys of earlier versions -> where they live now
MOVED = {
    "selection_scope": "selection.scope", "tbs_max_probes": "selection.tbs_max_probes",
    "trimmed_eps": "selection.trimmed_eps", "sample_fraction": "selection.sample_fraction",
    "threshold_reuse": "selection.threshold_reuse",
    "quantize": "message.quantize", "sign_rule": "message.sign_rule", "index_coding": "message.index_coding",
    "binarize": "message.binarize",
    "momentum_correction": "dgc.momentum_correction", "momentum_masking": "dgc.momentum_masking",
    "clip_norm": "dgc.clip_norm",
    "warmup_epochs": "warmup.epochs", "warmup_steps": "warmup.steps",
    "warmup_start_density": "warmup.start_density", "warmup_stages": "warmup.stages",
    "latency_s": "policy.latency_s", "bandwidth_gbit": "policy.bandwidth_gbit",
    "min_compress_numel": "policy.min_compress_numel", "layers": "policy.layers",
}


# a group given as one string: the group's main knob
SHORTHANDS = {"selection": "method", "policy": "mode"}


def expand_shorthands(section: dict) -> dict:
    """``selection: tbs`` -> ``selection: {method: tbs}``; ``policy: cost_model`` -> ``{mode: cost_model}``
    (IWP's selection is a plain choice and stays as it is)."""
    out = dict(section)
    for key, main in SHORTHANDS.items():
        if isinstance(out.get(key), str):
            out[key] = {main: out[key]}
    return out


def method_names() -> list[str]:
    return registry.method_names()


def check_density(value: float, field: str = "density") -> float:
    if not (0.0 < float(value) <= 1.0):
        raise ValueError(
            f"{field}={value!r} is outside (0, 1]: it is the fraction of each layer's "
            f"elements sent per step (e.g. 0.01 sends 1%; 1.0 sends everything)")
    return float(value)


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- groups -------------------------------------------------------------------------------
class LayerOverride(_Group):
    """Per-layer settings by parameter-name pattern (fnmatch, e.g. ``"embedding.*"``, ``"*fc*.weight"``).
    The first matching entry wins."""
    pattern: str
    density: Optional[float] = None
    selection: Optional[Selection] = None
    quantize: Optional[Literal["none", "fp16", "int8", "sign_mean"]] = Field(
        None, description="redsync: this layer's message.quantize, e.g. values (none) for an embedding or a "
                          "decoder, whose selected values one mean represents badly (docs/redsync.md)")
    dense: bool = Field(False, description="send this layer dense (fused allreduce)")

    @field_validator("density")
    @classmethod
    def _density(cls, v):
        return None if v is None else check_density(v, "layers[].density")


class BudgetConfig(_Group):
    """``policy.mode: budget``: one byte budget per step, shared by the compressed layers. Each
    layer's density is chosen from measured statistics of its compensated gradient so that the
    error the residuals carry (what is left unsent) is least, and chosen again every ``every``
    steps (policy/budget.py, docs/redsync.md)."""
    method: Literal["dp", "threshold"] = Field(
        "dp", description="dp: a dynamic program over each layer's error curve (L-GreCo), with the message's "
                          "quantisation in the error | threshold: one magnitude threshold for every layer "
                          "(hard-threshold sparsification), so each layer's k is what exceeds it")
    density: Optional[float] = Field(
        None, description="the budget as a mean density: the bytes uniform density would send (None: the "
                          "method's density, so the budget redistributes the same bytes)")
    bytes_per_step: Optional[int] = Field(
        None, description="... or as bytes each worker sends per step, every layer and the per-step flag "
                          "included (what metrics.jsonl's step_wire_bytes shows)")
    objective: Literal["error", "descent"] = Field(
        "error", description="dp: what a layer's k buys | error: the energy of x the message takes out of what the "
                             "residual carries (L-GreCo) | descent: the first-order decrease of the step's loss the "
                             "message buys, the sum of x * g over the sent elements (g the step's gradient): a "
                             "residual that this step's gradient does not touch (an embedding's rare rows) buys "
                             "little, however large")
    every: int = Field(200, ge=0, description="steps between two choices (from the end of the density warm-up); "
                                              "0: never (the uniform start, or a pinned decisions.json's)")
    spread: float = Field(16.0, ge=1.0, description="a layer's density stays within [mean / spread, mean * spread]")
    response: float = Field(
        1.0, ge=0.0, le=2.0, description="how a layer's residual answers a change of its k once error feedback has "
                                         "settled: x scales as k**-response (1: what enters each step leaves as k "
                                         "elements near the threshold; 0: judge by x as measured, which swings a "
                                         "starved layer's large residual back and forth)")

    @field_validator("density")
    @classmethod
    def _density(cls, v):
        return None if v is None else check_density(v, "policy.budget.density")

    @field_validator("bytes_per_step")
    @classmethod
    def _bytes(cls, v):
        if v is not None and v <= 0:
            raise ValueError(f"policy.budget.bytes_per_step={v!r} must be a positive number of bytes per worker "
                             "per step (or leave it out and give policy.budget.density)")
        return v

    @model_validator(mode="after")
    def _one_budget(self):
        if self.density is not None and self.bytes_per_step is not None:
            raise ValueError("policy.budget: give either density (a mean density) or bytes_per_step, not both")
        if self.objective == "descent" and self.method != "dp":
            raise ValueError("policy.budget.objective=descent weighs each layer's k by what it buys, which only the "
                             "dynamic program reads (method: dp); the threshold counts magnitudes: use "
                             "objective: error with method: threshold")
        return self


class PolicyConfig(_Group):
    """Which layers travel compressed. Small layers (biases, norms) cost more in latency and
    selection than they save in bytes; the cost model decides per layer from measured figures."""
    mode: Literal["static", "cost_model", "budget"] = Field(
        "static", description="static: compress every layer of at least min_compress_numel elements | "
                              "cost_model: compress a layer only where the alpha-beta model predicts a gain | "
                              "budget: as static, and each compressed layer's density is chosen under one byte "
                              "budget per step (policy.budget)")
    min_compress_numel: int = Field(0, ge=0, description="layers with fewer elements go dense (fused allreduce)")
    dense_values: Literal["fp32", "fp16", "int8"] = Field(
        "fp32", description="how the layers that go dense travel: fp32 (the exact average) | fp16 (half the "
                            "bytes; the rounding, 11 significant bits, is not fed back) | int8 (engine: fsdp: a "
                            "quarter of the bytes, codes with one scale per piece by an alltoall; the rounding "
                            "waits in the residual and is sent later). At 100x compression the dense biases can "
                            "cost as much as every compressed layer together")
    dense_in_gather_bytes: Union[Literal["auto"], NonNegativeInt] = Field(
        "auto", description="the layers that go dense travel inside the compressed layers' allgather, not in an "
                            "allreduce of their own, where their bytes total at most this (0: never). One "
                            "collective round a step fewer (a small Gloo allreduce costs about 0.4 ms on 2 CPU "
                            "cores), for N-1 copies of those bytes received instead of 2(N-1)/N. auto: the bytes "
                            "one round's latency buys, alpha x bandwidth of the network the cost model planned "
                            "for (31,250 bytes at its 25 us and 10 Gbit/s where nothing was measured): below it "
                            "riding costs at most half the latency it saves, at any N; biases and norms ride, a "
                            "large dense layer does not. Where the exchange allgathers (not the sparse "
                            "reduce-scatter, exact-k plans or FSDP)")
    layers: list[LayerOverride] = Field(default_factory=list, description="per-layer overrides")
    latency_s: Optional[float] = Field(None, ge=0, description="cost_model: cost of one collective round "
                                                               "(None: measured at start)")
    bandwidth_gbit: Optional[float] = Field(None, gt=0, description="cost_model: bandwidth (None: measured)")
    compute_s: Optional[tuple[float, float]] = Field(
        None, description="cost_model: a compressed layer's cost here as [seconds per layer, seconds per element] "
                          "(its selection, encoding, residual update and decoding; None: measured at start on the "
                          "model's smallest and largest layers). Given, with latency_s, bandwidth_gbit and overlap, "
                          "the plan no longer moves with the machine's load")
    review_every: int = Field(20, ge=0, description="cost_model: every this many steps, each compressed bucket's "
                                                   "measured seconds (averaged over ranks) are compared with its "
                                                   "predicted dense time, and it goes dense where it does not pay "
                                                   "(longer: less noise, a slow choice kept longer; 0: never)")
    review_margin: float = Field(0.1, ge=0, description="cost_model: how much slower than its predicted dense time "
                                                       "a compressed bucket may be measured before it goes dense "
                                                       "(0: flips on the model's own error; large: keeps buckets "
                                                       "that cost time)")
    overlap: Optional[float] = Field(None, ge=0, le=1, description="cost_model: the fraction of a dense "
                                     "allreduce hidden behind backward, which the dense side of each bucket's price "
                                     "leaves out (None: measured at start, engine/probes.py:probe_overlap; while "
                                     "training it is bounded by the measured compute per step)")
    decisions: Optional[Union[str, dict]] = Field(
        None, description="a decisions.json of a run folder: which layers travel compressed is taken from it "
                          "(no probing, no cost model), so runs of one config compress the same layers. A resume "
                          "fills it from the checkpoint")
    budget: BudgetConfig = Field(default_factory=BudgetConfig, description="mode: budget: the byte budget and "
                                                                          "how it is shared")

    @field_validator("compute_s")
    @classmethod
    def _compute(cls, v):
        if v is not None and (min(v) < 0 or not all(math.isfinite(x) for x in v)):
            raise ValueError(f"policy.compute_s={list(v)!r}: give [seconds per layer, seconds per element], both "
                             "finite and >= 0 (e.g. [2e-4, 5e-9]), or leave it out to measure them at start")
        return v


class SelectionConfig(_Group):
    """How RedSync finds about k of the residual's largest magnitudes, or exactly k per layer on the
    device (radix): the strategies of core/select/."""
    method: SelectionMethod = Field(
        "tbs", description="exact (torch.topk) | trimmed (exactly k) | tbs (threshold binary search, k to 2k) | "
                           "sampled (DGC's sampled threshold) | radix (exactly k per layer of a bucket by a radix "
                           "select on the device: no host wait in a step, message sizes known in advance so the "
                           "header allgather is skipped; with sign_mean k of the kept sign; Triton kernels on CUDA, "
                           "torch ops elsewhere; by bucket only, raw index coding only)")
    scope: Literal["auto", "layer", "bucket"] = Field(
        "auto", description="layer: select each layer in its gradient hook (per-layer searches, threshold "
                            "reuse; fastest on CPUs) | bucket: select all compressed layers of a bucket at "
                            "once when its last gradient arrives: tbs by histogram thresholds with one host "
                            "wait per bucket instead of several per layer, radix with none | auto: bucket for "
                            "radix; for tbs bucket on CUDA with no per-layer selection overrides, else layer")
    tbs_max_probes: int = Field(20, gt=0, description="tbs: probe budget before the exact fallback")
    trimmed_eps: float = Field(0.2, gt=0, lt=1, description="trimmed: step of the threshold ratio")
    sample_fraction: float = Field(0.01, gt=0, le=1, description="sampled: fraction of elements sampled")
    threshold_reuse: Union[int, Literal["auto"]] = Field(
        "auto", description="re-search a layer's threshold every R steps (or when the count leaves [k/2, 2k]); "
                            "else only count | auto: 5 under policy.mode: cost_model (the setting of the tuned "
                            "runs: a search costs several counting passes), 1 (a search every step) otherwise "
                            "and for exchanges of local steps (local_steps: auto's rule 8). "
                            "trimmed starts from its last threshold whatever R is: its exact top-k is the same")

    _reuse_auto: bool = PrivateAttr(False)   # threshold_reuse was auto: a number now, written back as auto

    @field_validator("threshold_reuse")
    @classmethod
    def _reuse(cls, v):
        if v != "auto" and (isinstance(v, bool) or int(v) < 1):
            raise ValueError(f"selection.threshold_reuse={v!r}: a whole number of steps of at least 1, or auto")
        return v

    @field_serializer("threshold_reuse")
    def _reuse_as_given(self, v):
        return "auto" if self._reuse_auto else v

    @property
    def reuse_chosen(self) -> bool:
        """``threshold_reuse`` is what ``auto`` became for this config's policy, not a number given."""
        return self._reuse_auto

    def resolved(self, reuse: int) -> "SelectionConfig":
        """This group with ``threshold_reuse: auto`` resolved to ``reuse``, remembered as chosen."""
        out = self.model_copy(update={"threshold_reuse": reuse})
        out._reuse_auto = True
        return out

    radix_backend: str = Field(
        "auto", description="radix: a backend of the selection registry (core/select/registry.py), checked when "
                            "the compressor is built: auto (Triton kernels on CUDA tensors, native passes on CPU "
                            "float32, torch ops elsewhere) | triton | native (CPU: the reference over a threshold "
                            "set the native passes find) | torch (the reference in plain torch ops, any device) | "
                            "any registered one")


class MessageConfig(_Group):
    """What a RedSync message carries besides the positions."""
    quantize: Literal["none", "fp16", "int8", "sign_mean"] = Field(
        "fp16", description="fp16: half values (48 bits an element with its index) | none: fp32 values (64 bits) | "
                            "int8: one byte a value and one fp32 scale per layer (40 bits with an int32 index; "
                            "what rounding loses waits in the residual; selection by tbs, trimmed, sampled or exact "
                            "only) | sign_mean: one sign, one mean per layer (32 bits an "
                            "element, about 1.7x fewer bytes at the same density; the other sign waits, and one "
                            "mean stands for values that differ)")
    sign_rule: Literal["alternate", "larger"] = Field(
        "alternate", description="sign_mean: alternate the sign every step (RedSync) | larger: the side "
                                 "with the larger mean magnitude (SBC)")
    index_coding: Literal["raw", "golomb"] = Field(
        "raw", description="raw (int32) | golomb (Golomb-Rice coded gaps: 8-12 bits each instead of 32, "
                           "for a sort and a CPU encode per layer)")


class SBCMessageConfig(_Group):
    """Sparse Binary Compression's message."""
    binarize: bool = Field(True, description="send one mean for the side (top-k positive or top-k negative) "
                                             "with the larger mean magnitude; false: send k values")
    index_coding: Literal["raw", "golomb"] = Field("golomb", description="golomb (Golomb-Rice coded gaps) | "
                                                                         "raw (int32)")
    values: Literal["fp32", "fp16"] = Field(
        "fp32", description="binarize: false: the k values as fp32, or as fp16 (half their bytes; the residual "
                            "keeps what rounding left out)")

    @property
    def quantize(self) -> str:
        return "sign_mean" if self.binarize else {"fp32": "none", "fp16": "fp16"}[self.values]

    @model_validator(mode="after")
    def _values_need_values(self):
        if self.binarize and self.values != "fp32":
            raise ValueError(f"message.values={self.values!r} sets how the k values travel, but binarize: true "
                             "sends one mean: set binarize: false, or leave values out")
        return self


class DGCConfig(_Group):
    """Deep Gradient Compression's corrections (Lin et al., ICLR 2018)."""
    momentum_correction: bool = Field(
        False, description="accumulate velocity, not gradient, in the residual; takes momentum and weight "
                           "decay out of the wrapped optimizer (which then runs plain SGD)")
    momentum_masking: Union[Literal["stale"], bool] = Field(
        True, description="zero the velocity where values were sent: true at every position sent; stale only "
                          "where the value sent had waited longer than 1/(1-momentum) steps (|v| > |u|/(1-m)), "
                          "so coordinates sent every few steps keep their momentum; false nowhere")
    clip_norm: Optional[float] = Field(None, gt=0, description="local per-layer gradient clipping at "
                                                               "clip_norm * N**-0.5 before accumulation")


class RedSyncDGCConfig(DGCConfig):
    """RedSync's DGC group: the momentum correction is on unless the config turns it off (a
    ``dgc`` section that names only the masking keeps it on)."""
    listed_as: ClassVar[type] = DGCConfig   # docs/configuration.md: one dgc table, redsync's default in its cells
    momentum_correction: bool = Field(
        True, description="accumulate velocity, not gradient, in the residual; takes momentum and weight "
                          "decay out of the wrapped optimizer (which then runs plain SGD)")


class WarmupConfig(_Group):
    """DGC's density warm-up: exponential decay from start_density to density in equal stages."""
    epochs: float = Field(0.0, ge=0, description="warm-up length in epochs")
    steps: int = Field(0, ge=0, description="... or in steps (takes precedence when > 0)")
    start_density: float = Field(0.25, description="density at the start of warm-up")
    stages: int = Field(4, ge=1, description="number of equal stages")
    min_sends: float = Field(0.0, ge=0, description=(
        "c > 0: the density follows the run, d_t = max(density, c / t) at step t (1-based), rounded up to a "
        "quarter octave: every coordinate could have been sent at least c times over the steps so far, so a "
        "residual's delay (about 1/d steps) stays at most t / c. Needs no run length; a short run stays close "
        "to dense, a long one reaches density. 0: off"))

    @field_validator("start_density")
    @classmethod
    def _start(cls, v):
        return check_density(v, "warmup.start_density")


# -- methods ------------------------------------------------------------------------------
class MethodConfig(BaseModel):
    """A method's name, and what it can do (class variables)."""
    model_config = ConfigDict(extra="forbid")
    method: str

    strategy: ClassVar[Literal["exchange", "decentralized"]] = "exchange"
    frameworks: ClassVar[tuple] = ("torch", "tensorflow")
    engines: ClassVar[tuple] = ("horovod", "ddp")
    delayed: ClassVar[bool] = False     # local steps between exchanges: the optimizer owns the timing
    weighs_by_weights: ClassVar[bool] = False   # the compressor reads the parameters (IWP's |w|)
    dense_fast_path: ClassVar[bool] = False     # nothing to compress: a DDP hook may use DDP's own reduction
    per_layer_quantize: ClassVar[bool] = False  # policy.layers[].quantize chooses a layer's message

    # what the engines read of a method's knobs, the same question for every method
    @property
    def corrects_momentum(self) -> bool:
        """DGC's momentum correction: the optimizer's momentum moves into the memory."""
        return False

    @property
    def local_clip(self) -> Optional[float]:
        """DGC's local clipping norm, or None."""
        return None

    @property
    def follows_own_lr(self) -> bool:
        """``residual_lr: own``: residuals are rescaled when the learning rate changes."""
        return False

    @property
    def updates_in_step(self) -> bool:
        """``sparse_update``: compressed layers are decoded into the weights inside step()."""
        return False

    @property
    def in_update_units(self) -> bool:
        """``feedback_units: update`` (or ``auto``): residuals hold each worker's own Adam steps, not
        gradients, where the optimizer is one the adapter reproduces."""
        return False

    @property
    def residual_decay(self) -> float:
        """The residual is multiplied by this before a step joins it (DeMo's decay; 1: kept whole)."""
        return 1.0

    @property
    def steps_by_sign(self) -> bool:
        """Update units: weights move by lr * sign of the average sent (DeMo's step)."""
        return False

    @property
    def warmup_schedule(self) -> Optional["WarmupConfig"]:
        """The density warm-up, where the method has one."""
        return None

    def limits(self) -> str:
        """Why the method runs only where ``frameworks`` and ``engines`` say, for error messages."""
        return "exchanges gradients"

    # why its messages cannot become FSDP's reduce-scatter (one sum per shard, once per step)
    sharded_limits: ClassVar[Optional[str]] = None

    def sharded_problems(self) -> dict:
        """{setting: fix} of what engine: fsdp's compressed reduce-scatter (exchange/sharded.py)
        cannot do with this config's knobs; empty where it can."""
        return {}

    @property
    def uses_memory(self) -> bool:
        return False

    def layer_density(self) -> float:
        """Fraction of a compressed layer sent per step (1.0: everything)."""
        return 1.0


def policy_with_floor(value: Any, floor: int) -> Any:
    """A static policy given without ``min_compress_numel`` keeps the method's floor (RedSync's and
    IWP's 4096): a ``policy: {layers: [...]}`` must not compress every bias at k = 1 by leaving it
    out. The cost model (``mode: cost_model``) decides small layers itself, from a floor of 0."""
    if isinstance(value, str):
        value = {"mode": value}
    if isinstance(value, dict) and value.get("mode", "static") == "static" and "min_compress_numel" not in value:
        value = {**value, "min_compress_numel": floor}
    return value


class CompressionConfig(MethodConfig):
    """Knobs every method of the gradient exchange shares."""
    check_finite: Optional[bool] = Field(
        None, description="null (the default): true where the method keeps a residual (error feedback), false "
                          "where it keeps none (none, fp16, qsgd, residual: false), as Horovod passes NaN on. "
                          "true: stop with a clear error on NaN/Inf gradients (all ranks agree, residuals untouched); "
                          "costs one reduction per bucket (per layer for compressors that do not check "
                          "themselves), carried in the bucket's own collective, and one read per step. false: "
                          "the same reductions, and NaN/Inf passes on into the averaged gradients (as an "
                          "uncompressed average does: per element for dense fp32 layers, the whole layer for "
                          "compressed or fp16 ones) while residuals, velocities and compressor state stay finite "
                          "(docs/horovod_api.md)")
    fusion_bytes: int = Field(
        16 << 20, gt=0, description="layers are packed into buckets of at most this many dense bytes; one bucket "
                                    "= one allreduce or allgather (fewer collectives, later start)")
    cuda_graph: Literal["auto", "on", "off"] = Field(
        "auto", description="buckets with exactly k per layer on CUDA (selection.method: radix): auto replays each "
                            "bucket's compressed step from a CUDA graph once its layout has run twice (eager where "
                            "capture is refused, logged) | on: the same, but a refused capture is an error | off: "
                            "eager (a few launches per bucket and step)")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="which layers compress")

    @property
    def finite_check(self) -> bool:
        """check_finite as set; unset, on exactly where a residual would keep a NaN for good."""
        return self.uses_memory if self.check_finite is None else self.check_finite

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_shorthand(cls, v):
        return {"mode": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _quantize_overrides_are_redsyncs(self):
        if not self.per_layer_quantize and any(o.quantize for o in self.policy.layers):
            raise ValueError(f"policy.layers[].quantize chooses a RedSync message per layer; method {self.method!r} "
                             "has one message format: remove quantize from the override")
        return self

    def budget_refusal(self) -> Optional[str]:
        """Why ``policy.mode: budget`` cannot share bytes by choosing each layer's k here (None: it can)."""
        return f"compression.method={self.method!r} sends no chosen number of elements per layer"

    @model_validator(mode="after")
    def _budget_runs(self):
        why = self.budget_refusal() if self.policy.mode == "budget" else None
        if why:
            raise ValueError(f"policy.mode=budget holds a byte budget by choosing each layer's k, but {why}. Use "
                             "method: redsync with selection.method: radix, or method: topk; or policy.mode: static")
        return self


class NoneConfig(CompressionConfig):
    """Dense fp32 allreduce (Horovod's default): the baseline everything is compared to."""
    dense_fast_path: ClassVar[bool] = True
    engines: ClassVar[tuple] = ("horovod", "ddp", "fsdp")


class FP16Config(CompressionConfig):
    """Dense allreduce in half precision: 2x fewer bytes, no residual."""
    sharded_limits: ClassVar[Optional[str]] = ("is a dense fp16 allreduce (under FSDP: "
                                               "MixedPrecisionPolicy(reduce_dtype=torch.float16))")


class ResidualConfig(CompressionConfig):
    """Sparse methods with error feedback: what is not sent stays in a per-worker residual."""
    density: float = Field(0.01, description="fraction of each layer's elements sent per step, in (0, 1]")
    residual: bool = Field(True, description="keep what is not sent and add it to the next gradient (error feedback)")
    residual_lr: Literal["send", "own"] = Field(
        "send", description="which learning rate a gradient that waited in the residual is applied with: send (the "
                            "learning rate of the step that sends it, as RedSync and DGC) | own (its own step's: "
                            "when the learning rate goes from a to b, residuals are multiplied by a / b, error "
                            "feedback in units of the update as in Karimireddy et al.'s EF-SGD; a decaying schedule "
                            "then no longer shrinks what waited. PyTorch under horovodrun; docs/redsync.md)")
    dgc: DGCConfig = Field(default_factory=DGCConfig, description="DGC's corrections")
    warmup: WarmupConfig = Field(default_factory=WarmupConfig, description="density warm-up")

    @field_validator("density")
    @classmethod
    def _density(cls, v: float) -> float:
        return check_density(v)

    @model_validator(mode="after")
    def _dgc_needs_residual(self):
        if self.dgc.momentum_correction and not self.residual:
            raise ValueError("dgc.momentum_correction keeps the velocity in the residual: it needs residual: true")
        return self

    @property
    def uses_memory(self) -> bool:
        return self.residual

    def layer_density(self) -> float:
        return self.density

    @property
    def corrects_momentum(self) -> bool:
        return self.dgc.momentum_correction

    @property
    def local_clip(self) -> Optional[float]:
        return self.dgc.clip_norm

    @property
    def follows_own_lr(self) -> bool:
        return self.residual_lr == "own"

    @property
    def warmup_schedule(self) -> Optional[WarmupConfig]:
        return self.warmup


_SPARSE_UPDATE = ("PyTorch, plain SGD only: apply each compressed layer's averaged sparse gradient straight to its "
                  "weights inside step(), instead of writing a dense .grad that is almost all zeros and updating "
                  "every weight. Saves two passes over the compressed layers per step (worth it on CPUs; a GPU "
                  "does those passes in microseconds). Those parameters' .grad is None after step(); call "
                  "synchronize() first to see dense averaged gradients (e.g. to clip them). Needs torch.optim.SGD "
                  "without momentum and weight decay in the optimizer (dgc.momentum_correction takes both out) | "
                  "auto: on under policy.mode: cost_model where redsync_hvd.torch.DistributedOptimizer under "
                  "horovodrun wraps such an SGD with the allgather and no GradScaler (layers.log says which), "
                  "off otherwise")


_FEEDBACK_UNITS = ("what the residual holds under Adam and AdamW. gradient: the gradient (x = r + g, the "
                   "optimizer steps on the averaged decompressed gradient) | update: each worker keeps its own "
                   "Adam moments from its own gradient, feeds its own Adam direction into the residual and sends "
                   "the top of that; every worker applies lr * the average sent, plus AdamW's decoupled decay "
                   "(error feedback in update units, Chen et al. 2021). Dense layers keep the optimizer's own Adam. "
                   "Costs two moment buffers per compressed layer per worker. PyTorch's torch.optim.Adam and AdamW "
                   "under engine: horovod or ddp; elsewhere gradient units, with a note (docs/redsync.md) | auto: "
                   "update where the adapter can read a plain torch Adam or AdamW (no amsgrad, no maximize), "
                   "gradient under any other optimizer without a note (a note only where the optimizer is Adam "
                   "and its step cannot be reproduced). Under SGD, DGC's momentum correction already is error "
                   "feedback in update units")


_AGGREGATION = ("how a bucket's (position, value) messages meet. allgather: every rank receives every "
                "rank's message ((N-1)*k entries, growing with N; one collective) | sparse_reduce_scatter: "
                "Ok-Topk's balanced sparse reduce-scatter: each rank's entries go by alltoall to the owners of "
                "their positions (hashed regions), each owner sums them and keeps the ceil(k/N) largest per "
                "layer, an allgather gives every rank those (about 2k(N-1)/N entries received, flat in N; two "
                "collectives). What an owner does not keep goes back into its sender's residual. Golomb-coded "
                "positions and int8 values are coded per owner, decoded before the owners sum. Not with "
                "sparse_update | auto: per bucket, the path the cost model predicts "
                "faster for this N, k and network (policy.latency_s / bandwidth_gbit, else probed at start); "
                "the choice is in the run folder's layers.log")


_LOCAL_STEPS = ("optimizer steps each worker takes on its own between exchanges (DiLoCo's inner steps, "
                "Douillard et al. 2023). Above 1, every local_steps steps each worker sends its model delta plus "
                "its residual through the same selection and message, and every worker restarts from the "
                "common weights plus the average sent (SparseLoCo, Sarfi et al. 2025: top-k of the "
                "pseudo-gradient with error feedback); momentum and Adam's moments stay in each worker's "
                "optimizer. local_steps times fewer collectives, and the delta of many steps is sent at once, so "
                "a higher density per exchange pays (docs/redsync.md, 'Local steps'). Workers drift apart "
                "between exchanges. PyTorch under engine: horovod or ddp (the DDP hook then sends nothing and "
                "register() makes the optimizer's step the round's); 1: every step (topk's default) | auto "
                "(redsync's default): 8 where the delayed step runs (PyTorch under engine: horovod, or ddp with "
                "the optimizer given to register(); none of the per-step knobs below set, not under "
                "Horovod Elastic), each exchange sending 8 x density of the "
                "delta but at least 0.1 of it (below 0.1 the text cells lost perplexity), with Golomb-coded "
                "positions (raw under radix); every step elsewhere, at density. "
                "The choice is in layers.log")

_LOCAL_DECAY = ("with local steps: each worker's residual is multiplied by this before its next delta joins it "
                "(SparseLoCo's error-feedback decay, Sarfi et al. 2025), so what waited longer than about "
                "1 / (1 - local_decay) exchanges fades instead of arriving late, and the residual acts as a "
                "decaying outer momentum. 1: kept whole (the default). With an exchange every step it does not apply")

_OUTER = ("with local steps: DiLoCo's outer optimizer (Douillard et al. 2023), Nesterov momentum on the average "
          "delta of each exchange: buf = outer_momentum * buf + delta, and the weights move by outer_lr * (delta + "
          "outer_momentum * buf) instead of by delta. One buffer per parameter, the same on every rank. DiLoCo "
          "uses outer_lr 0.7 and outer_momentum 0.9 after hundreds of local steps; at outer_momentum 0 and outer_lr "
          "1 (the default) the weights move by the average delta. With an exchange every step it does not apply")

_ADAM_VARIANCE = ("where each worker takes its own Adam or AdamW steps (feedback_units: update, or local_steps "
                  "above 1), what its step divides by. own: its second moment v, from its own gradient, as Adam "
                  "does | of_average: an estimate of the second moment of the N workers' average gradient, "
                  "v_hat / N + (1 - 1/N) * m_hat**2, what dense Adam divides by. A worker's own v carries its "
                  "gradient noise in full, up to N times the average's, so its steps are up to sqrt(N) times "
                  "smaller where noise dominates: the averaged run learns more slowly than dense. Costs nothing "
                  "on the wire; memory/adam.py | shared (local steps only): at each exchange the workers' "
                  "of_average estimates are averaged (one dense fp32 allreduce of every Adam parameter's size) "
                  "and every worker divides its next round's steps by that same number (or by its own estimate / N "
                  "where that is larger: a gradient the last exchange had not seen), so the average of their "
                  "steps is Adam's step of their average momentum; a worker's estimate alone moves a rare "
                  "coordinate that only its batch touched by its own variance. Costs a dense exchange of v per "
                  "round: a diagnostic, not a default; torch/update_units.py | shared_factored: the same, with each "
                  "matrix's estimate sent as its row and column means and rebuilt as their outer product over the "
                  "mean (Adafactor's factored second moment, Shazeer and Stern 2018): rows + columns numbers a "
                  "round instead of rows x columns")

LOCAL_STEPS_RUN = (("torch", "horovod"), ("torch", "ddp"))   # where local_steps: auto takes local steps
AUTO_LOCAL_STEPS = 8   # docs/benchmarks.md, "Local steps": 8 steps held the cells the per-step default misses
AUTO_EXCHANGE_DENSITY = 0.1   # the least an exchange of auto's local steps sends of each delta (ibid.)
# sends of a whole layer (density x the run's steps) from which auto under Adam runs every step in
# gradient units: the long GPT held dense at 50 and 100, the 800-step GPT lost 46% at 8
# (docs/benchmarks.md, "Gradient units on long runs under AdamW")
AUTO_EVERY_STEP_SENDS = 50


class AllgatherConfig(ResidualConfig):
    """Sparse methods whose messages (own positions, own values) travel by allgather, or by a sparse
    reduce-scatter (``aggregation``); under FSDP (``engine: fsdp``) through FSDP's reduce-scatter."""
    sparse_update: Union[bool, Literal["auto"]] = Field("auto", description=_SPARSE_UPDATE)
    aggregation: Literal["allgather", "sparse_reduce_scatter", "auto"] = Field("allgather",
                                                                                description=_AGGREGATION)
    residual_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="engine: fsdp: how residuals and velocities are stored between steps: fp32 | bf16 "
                            "(half the memory; each step still adds and selects in fp32, and the rounding to bf16 "
                            "is not fed back; docs/fsdp.md). The other engines keep fp32")
    feedback_units: Literal["auto", "gradient", "update"] = Field("auto", description=_FEEDBACK_UNITS)
    frozen_variance_after: int = Field(
        0, ge=0, description="feedback_units in update units: after this many steps each worker's second moment "
                             "stops moving (1-bit Adam's frozen variance, Tang et al. 2021), so its Adam direction "
                             "is its momentum over a fixed per-coordinate scale and a residual that waited keeps "
                             "its size. Frozen early, v misses how gradients shrink late in the run; 0: never")
    adam_variance: Literal["own", "of_average", "shared", "shared_factored"] = Field("own",
                                                                                     description=_ADAM_VARIANCE)
    local_steps: Union[Literal["auto"], int] = Field(1, description=_LOCAL_STEPS)
    local_decay: float = Field(1.0, gt=0, le=1, description=_LOCAL_DECAY)
    outer_lr: float = Field(1.0, gt=0, description="outer_lr: " + _OUTER)
    outer_momentum: float = Field(0.0, ge=0, lt=1, description="outer_momentum: " + _OUTER)

    @field_validator("local_steps", mode="before")
    @classmethod
    def _steps_or_auto(cls, v):
        if isinstance(v, str) and v != "auto" and not v.strip().isdigit():
            raise ValueError(f"local_steps: {v!r}: give a count of steps (1: every step) or auto")
        return v

    @field_validator("local_steps")
    @classmethod
    def _positive_steps(cls, v):
        if v != "auto" and v < 1:
            raise ValueError(f"local_steps: {v}: give 1 (every step), a larger count of local steps, or auto")
        return v

    @property
    def delayed(self) -> bool:
        """Local steps run; ``auto`` not yet settled for an engine counts as every step."""
        return self.local_steps != "auto" and self.local_steps > 1

    @property
    def engines(self) -> tuple:
        return ("horovod", "ddp") if self.delayed else ("horovod", "ddp", "fsdp")

    @property
    def frameworks(self) -> tuple:
        return ("torch",) if self.delayed else ("torch", "tensorflow")

    def limits(self) -> str:
        return ("exchanges model deltas after local steps (local_steps), which needs the optimizer to own the update"
                if self.delayed else super().limits())

    @model_validator(mode="before")
    @classmethod
    def _local_steps_keep_momentum_local(cls, data):
        """Under local steps the optimizer's own momentum runs on every worker between rounds: DGC's
        momentum correction (RedSync's default) is off unless the config names it."""
        steps = data.get("local_steps", 1) if isinstance(data, dict) else 1
        if isinstance(steps, int) and steps > 1:
            dgc = data.get("dgc") if isinstance(data.get("dgc"), dict) else {}
            if "momentum_correction" not in dgc:
                data = {**data, "dgc": {**dgc, "momentum_correction": False}}
        return data

    @model_validator(mode="after")
    def _local_steps_send_deltas(self):
        if self.local_decay != 1.0 and self.local_steps == 1:
            raise ValueError(f"local_decay: {self.local_decay} fades the residual between exchanges of local steps; "
                             "with local_steps: 1 there are none: set local_steps (a count, or auto), or remove "
                             "local_decay")
        outer = [f"{k}: {v}" for k, v in (("outer_lr", self.outer_lr), ("outer_momentum", self.outer_momentum))
                 if v != type(self).model_fields[k].default]
        if outer and self.local_steps == 1:
            raise ValueError(f"{', '.join(outer)} steps on the average delta of an exchange of local steps (DiLoCo's "
                             "outer optimizer); with local_steps: 1 the gradients are averaged every step and the "
                             "wrapped optimizer steps on them: set local_steps (a count, or auto), or remove "
                             f"{' and '.join(k.split(':')[0] for k in outer)}")
        if not self.delayed:
            return self
        named = ["dgc.momentum_correction: true"] * self.dgc.momentum_correction + self.per_step_knobs()
        if named:
            raise ValueError(f"local_steps: {self.local_steps} sends each worker's model delta after its own "
                             f"optimizer steps, where {', '.join(named)} cannot apply (momentum, clipping and "
                             "Adam stay in the local optimizer; the average is applied to the weights): "
                             "remove them, or set local_steps: 1")
        return self

    def per_step_knobs(self) -> list:
        """The knobs set here that only an exchange every step runs (local steps refuse them)."""
        clash = {"dgc.clip_norm": self.dgc.clip_norm is not None,
                 "feedback_units: update": self.feedback_units == "update",
                 "sparse_update: true": self.sparse_update is True,
                 "residual_lr: own": self.residual_lr == "own",
                 "policy.mode: budget": self.policy.mode == "budget"}   # a byte budget for each step
        return [k for k, bad in clash.items() if bad]

    def settle(self, framework: str, engine: str, elastic: bool = False, sgd: bool = False,
               adam: bool = False, steps: int | None = None) -> "AllgatherConfig":
        """``local_steps: auto`` made concrete where the exchange is built (a set count is kept):
        1. Local steps run in PyTorch's DistributedOptimizer under horovodrun and under the DDP hook
           (which makes the optimizer's step the round's), by allgather, with none of
           ``per_step_knobs``, outside Horovod Elastic (whose reset broadcasts one model); anywhere
           else (FSDP2, whose shards no worker could step alone; TensorFlow) auto is every step at
           ``density``. Under FSDP2 RedSync's positions are then Golomb-coded, each owner's share
           as places in its shard: the same entries in fewer bytes, for a host encode per group and
           step (raw where the config names radix, as in 4); the layers that go dense as int8
           codes, their rounding kept in the residual (``_sharded``: int8 in place of fp32, fp16
           given kept), and under SGD the values as in 5 (docs/fsdp.md, "Measured").
        2. There it is ``AUTO_LOCAL_STEPS`` steps, and an exchange sends ``AUTO_LOCAL_STEPS x density``
           of each delta, but at least ``AUTO_EXCHANGE_DENSITY``: below 0.1 an exchange the text cells
           lost perplexity (docs/benchmarks.md, "Local steps"). ``density`` keeps its meaning of what
           a step sends on average where it asks for more.
        3. DGC's momentum correction goes off, named or not: the optimizer's momentum runs on every
           worker (a run config reaches the optimizer dumped and parsed again, so whether the
           correction was named cannot be told here; set local_steps: 1 to keep it).
        4. RedSync's positions are Golomb-coded (raw under radix, which keeps the step on the device):
           the host encode runs once an exchange, and at 0.1 a gap takes about 5 bits instead of 32.
           The cells in (2) were measured so; a set local_steps keeps the coding given.
        5. Under torch.optim.SGD (``sgd``) RedSync's fp16 values travel as int8 codes with one scale
           a layer: 1.6x fewer bytes, and every momentum-SGD cell ended where fp16 ends (the Fashion
           CNN at 2.7x PowerSGD's ratio, where fp16 reaches 1.7x). Under AdamW int8 cost the GPT 2%
           perplexity on five seeds, so any other optimizer keeps fp16 (docs/benchmarks.md, "int8
           values"). A set local_steps keeps the values given. 4 and 5 apply to the sparse
           reduce-scatter too: it codes each owner's positions and values the same way, and the
           owners decode before they sum (``exchange/scatter_wire.py``).
        6. Under torch's Adam or AdamW (``adam``: a step the adapter reproduces) ``adam_variance:
           own`` becomes ``shared_factored``: every worker divides its local steps by one variance,
           averaged at each exchange as each matrix's row and column means. Over seeds 0-2 it
           halved the default's gap on both GPT cells at about the same ratio (docs/benchmarks.md,
           "Each worker's own Adam variance"). A set local_steps keeps the variance given.
        7. But under Adam or AdamW, where 1. takes local steps, a run long enough to send every
           layer ``AUTO_EVERY_STEP_SENDS`` times at ``density`` (``steps``: the run's length, where
           the caller knows it; the runner does) exchanges every step instead: error feedback in
           gradient units, AdamW stepping once on the average as under PowerSGD; Golomb-coded
           positions (raw under radix); the layers that go dense in fp16. On the long GPT it
           ended below dense at 125x, where 6. ends 8.9% above; the 800-step GPT lost 46% so
           (docs/benchmarks.md, "Gradient units on long runs under AdamW").
        8. Where 1. takes local steps, ``threshold_reuse: auto`` is 1 (5 under the cost model): each
           exchange searches afresh, as under the static policy the convergence matrix ran; a reused
           threshold seldom held a round's count, and the count plus the re-search cost more than a
           search (docs/benchmarks.md, "Threshold reuse across exchanges of local steps")."""
        if self.local_steps != "auto":
            return self
        if (framework, engine) not in LOCAL_STEPS_RUN or elastic or self.per_step_knobs():    # 1.
            return self.model_copy(update={"local_steps": 1, **(self._sharded(sgd) if engine == "fsdp" else {})})
        if adam and steps and self.density * steps >= AUTO_EVERY_STEP_SENDS:                          # 7.
            return self._every_step_in_gradient_units()
        return self.model_copy(update=self._local_steps_update(sgd, adam))

    def _local_steps_update(self, sgd: bool, adam: bool) -> dict:
        """``settle``'s rules 2-6 and 8: what ``local_steps: auto`` changes where it takes local steps."""
        density = min(1.0, max(AUTO_EXCHANGE_DENSITY, self.density * AUTO_LOCAL_STEPS))               # 2.
        update = {"local_steps": AUTO_LOCAL_STEPS, "density": density,
                  "dgc": self.dgc.model_copy(update={"momentum_correction": False})}                   # 3.
        message, selection = getattr(self, "message", None), getattr(self, "selection", None)
        if isinstance(message, MessageConfig) and selection.method != "radix":                        # 4.
            int8 = sgd and message.quantize == "fp16"                                                  # 5.
            update["message"] = message.model_copy(update={"index_coding": "golomb",
                                                           "quantize": "int8" if int8 else message.quantize})
        if adam and self.adam_variance == "own":                                                      # 6.
            update["adam_variance"] = "shared_factored"
        if getattr(selection, "reuse_chosen", False) and selection.threshold_reuse != 1:                # 8.
            update["selection"] = selection.resolved(1)
        return update

    def _every_step_in_gradient_units(self) -> "AllgatherConfig":
        """``settle``'s rule 7: an exchange every step, error feedback in gradient units, Golomb
        positions (raw under radix, as in 4) and the dense layers in fp16."""
        return self.model_copy(update={"local_steps": 1, "feedback_units": "gradient", **self._golomb(),
                                       "policy": self.policy.model_copy(update={"dense_values": "fp16"})})

    def _sharded(self, sgd: bool = False) -> dict:
        """``settle``'s rule 1 under FSDP2: Golomb-coded positions, the dense layers as int8 codes (a
        quarter of their bytes, which were four fifths of what the digits CNN sent), and under
        torch.optim.SGD rule 5's int8 values (11-17% more ratio on the four FSDP2 image cells, each
        still within its target; docs/fsdp.md, "Measured")."""
        update = self._golomb()
        if sgd and "message" in update and update["message"].quantize == "fp16":
            update["message"] = update["message"].model_copy(update={"quantize": "int8"})
        if self.policy.dense_values == "fp32":   # fp16 given is kept; a set local_steps keeps fp32
            update["policy"] = self.policy.model_copy(update={"dense_values": "int8"})
        return update

    def _golomb(self) -> dict:
        """The update that Golomb-codes RedSync's positions (none under radix, which keeps the
        step on the device, nor for a method without RedSync's message)."""
        message, selection = getattr(self, "message", None), getattr(self, "selection", None)
        if isinstance(message, MessageConfig) and selection.method != "radix":
            return {"message": message.model_copy(update={"index_coding": "golomb"})}
        return {}

    @model_validator(mode="after")
    def _average_variance_needs_own_steps(self):
        if self.adam_variance != "own" and not (self.in_update_units or self.local_steps != 1):
            raise ValueError(f"adam_variance: {self.adam_variance} changes each worker's own Adam steps, which only "
                             "feedback_units: update or local_steps above 1 (or auto) take: set one of them, or "
                             "leave adam_variance out")
        if self.adam_variance.startswith("shared") and self.local_steps == 1:
            raise ValueError(f"adam_variance: {self.adam_variance} averages the workers' variances at each exchange of "
                             "local steps, and local_steps is 1: set local_steps above 1 (or auto), or use of_average")
        return self

    @model_validator(mode="after")
    def _frozen_needs_update_units(self):
        if self.frozen_variance_after and not self.in_update_units:
            raise ValueError(f"frozen_variance_after: {self.frozen_variance_after} freezes each worker's own Adam "
                             "variance, which only error feedback in update units keeps: set feedback_units: update "
                             "(or auto), or leave frozen_variance_after out")
        return self

    @property
    def updates_in_step(self) -> bool:
        return self.sparse_update is True

    @property
    def may_update_in_step(self) -> bool:
        """``sparse_update: auto`` under the cost model: the torch adapter turns it on where its
        optimizer is plain SGD (``torch/optimizer.py``)."""
        return self.sparse_update == "auto" and self.policy.mode == "cost_model" and self.aggregation == "allgather"

    @property
    def in_update_units(self) -> bool:
        """Local steps send the optimizer's own steps already: no second conversion."""
        return self.feedback_units in ("auto", "update") and self.residual and not self.delayed

    def sharded_problems(self) -> dict:
        problems = {
            "policy.mode: budget": (self.policy.mode == "budget", "the budget observes the exchange's buckets; set "
                                                                   "policy.mode: static or cost_model"),
            "dgc.clip_norm": (self.dgc.clip_norm is not None, "clip the sharded gradients with "
                                                              "torch.nn.utils.clip_grad_norm_ instead; remove "
                                                              "dgc.clip_norm"),
            "residual: false": (not self.residual, "FSDP's compressed reduce-scatter keeps what it does not send; "
                                                   "set residual: true"),
        }
        return {what: fix for what, (bad, fix) in problems.items() if bad}

    @model_validator(mode="after")
    def _reduce_scatter_decodes_into_averages(self):
        if self.aggregation == "allgather":
            return self
        if self.sparse_update is True:
            raise ValueError(f"aggregation={self.aggregation!r} with sparse_update: a reduce-scatter bucket is "
                             "decoded into dense averages, not applied to the weights in step(); set "
                             "sparse_update: false, or aggregation: allgather")
        return self


class TopKConfig(AllgatherConfig):
    """Exact top-k by magnitude (torch.topk), sent as (int32 index, fp32 value) pairs over allgather."""

    def budget_refusal(self) -> Optional[str]:
        return None


class RandomKConfig(ResidualConfig):
    """k random positions drawn from a seed shared by all ranks, so only values travel, by allreduce."""
    seed: int = Field(0, description="shared seed; the positions change every step")
    sharded_limits: ClassVar[Optional[str]] = "allreduces values at positions drawn from a shared seed"


class RedSyncConfig(AllgatherConfig):
    """RedSync: residual gradient compression with fast selection and quantised messages.
    See docs/redsync.md for each knob's trade-off."""
    per_layer_quantize: ClassVar[bool] = True
    density: float = Field(0.001, description="fraction of each compressed layer sent per step, in (0, 1]")
    local_steps: Union[Literal["auto"], int] = Field("auto", description=_LOCAL_STEPS)
    selection: SelectionConfig = Field(default_factory=SelectionConfig, description="how k elements are found")
    message: MessageConfig = Field(default_factory=MessageConfig, description="what travels")
    dgc: RedSyncDGCConfig = Field(default_factory=RedSyncDGCConfig, description="DGC's corrections")
    policy: PolicyConfig = Field(default_factory=lambda: PolicyConfig(min_compress_numel=4096),
                                 description="which layers compress (min_compress_numel 4096 unless given)")

    @field_validator("selection", mode="before")
    @classmethod
    def _selection_shorthand(cls, v):
        return {"method": v} if isinstance(v, str) else v

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_floor(cls, v):
        return policy_with_floor(v, 4096)

    @model_validator(mode="after")
    def _reuse_by_policy(self):
        """``selection.threshold_reuse: auto`` becomes a number here, so every reader sees one: 5 where
        the cost model decides (the tuned runs' setting), 1 elsewhere. A dump writes ``auto`` back,
        so a config read again resolves it again for its own policy."""
        if self.selection.threshold_reuse == "auto":
            self.selection = self.selection.resolved(5 if self.policy.mode == "cost_model" else 1)
        return self

    def budget_refusal(self) -> Optional[str]:
        methods = {self.selection.method} | {o.selection for o in self.policy.layers if o.selection}
        loose = sorted(methods & {"tbs", "sampled"})
        if loose:
            return (f"selection.method={loose[0]} sends about k elements (tbs: k to 2k), so no byte count holds; "
                    "set selection.method: radix (exactly k per layer, any device), or trimmed with "
                    "message.quantize: none")
        if self.message.index_coding == "golomb":
            return "message.index_coding=golomb sends a varying number of bits per position; set index_coding: raw"
        if self.message.quantize == "sign_mean" and self.selection.method != "radix":
            return (f"message.quantize=sign_mean with selection.method={self.selection.method} sends the kept "
                    "sign's part of k (about half, varying); set selection.method: radix (exactly k of that sign)")
        return None

    @model_validator(mode="after")
    def _bucket_scope_is_tbs(self):
        s = self.selection
        if s.method == "radix":
            if s.scope == "layer" or any(o.selection or o.quantize for o in self.policy.layers):
                raise ValueError("selection.method=radix selects exactly k for every layer of a bucket at once, "
                                 "with one message format: set selection.scope: bucket (or auto) and drop per-layer "
                                 "selection overrides and per-layer quantize overrides")
            if self.message.quantize == "int8":
                raise ValueError("selection.method=radix writes its values in the wire's float type on the device; "
                                 "message.quantize: int8 needs each layer's scale first: set message.quantize: fp16, "
                                 "or another selection.method")
            if self.message.index_coding == "golomb":
                raise ValueError("selection.method=radix keeps the step on the device, but Golomb index coding "
                                 "encodes on the host: set message.index_coding: raw, or another selection.method")
        elif s.scope == "bucket" and (s.method != "tbs" or any(o.selection or o.quantize for o in self.policy.layers)):
            raise ValueError("selection.scope=bucket selects by histogram thresholds, which is tbs "
                             "(k to 2k elements per layer), or exactly k with radix, with one message format: set "
                             "selection.method: tbs or radix and drop per-layer selection overrides and per-layer "
                             "quantize overrides, or use selection.scope: layer")
        return self


class IWPConfig(ResidualConfig):
    """Importance-weighted pruning (Cheng & Xu): a leader picks the top |residual|/(|w|+eps)
    positions, broadcasts them, and every rank's values there are summed by one plain allreduce."""
    seed: int = Field(0, description="shared seed of the per-step leader draw (no communication to agree)")
    sharded_limits: ClassVar[Optional[str]] = "allreduces values at positions a leader broadcasts"
    eps: float = Field(1e-8, gt=0, description="importance = |residual| / (|weight| + eps)")
    selection: Literal["exact", "trimmed"] = Field("trimmed", description="exact | trimmed (exactly k indices "
                                                                          "are needed)")
    policy: PolicyConfig = Field(default_factory=lambda: PolicyConfig(min_compress_numel=4096),
                                 description="which layers compress (min_compress_numel 4096 unless given)")
    weighs_by_weights: ClassVar[bool] = True

    @field_validator("selection", mode="before")
    @classmethod
    def _plain_selection(cls, v):
        return v.get("method") if isinstance(v, dict) and set(v) == {"method"} else v

    @field_validator("policy", mode="before")
    @classmethod
    def _policy_floor(cls, v):
        return policy_with_floor(v, 4096)

    @model_validator(mode="after")
    def _exact_k_overrides(self):
        for o in self.policy.layers:
            if o.selection not in (None, "exact", "trimmed"):
                raise ValueError(f"policy.layers[].selection={o.selection!r}: iwp needs exactly k indices, "
                                 "so only exact or trimmed")
        return self


class SBCConfig(ResidualConfig):
    """Sparse Binary Compression (Sattler et al.): n local steps, then the accumulated model
    delta plus residual is sparsified, binarised (one mean, one sign) and its positions
    Golomb-coded; every rank decodes all messages and applies their average."""
    local_steps: int = Field(10, ge=1, description="optimizer steps between communications (1: per-step "
                                                   "gradient compression)")
    message: SBCMessageConfig = Field(default_factory=SBCMessageConfig, description="what travels")
    frameworks: ClassVar[tuple] = ("torch",)
    engines: ClassVar[tuple] = ("horovod",)
    delayed: ClassVar[bool] = True

    def limits(self) -> str:
        return ("exchanges model deltas after local steps (communication delay, local_steps), which needs the "
                "optimizer to own the update")

    @model_validator(mode="after")
    def _no_dgc_no_selection(self):
        if self.dgc.momentum_correction or self.dgc.clip_norm:
            raise ValueError("sbc exchanges model deltas after local steps; momentum and clipping stay in the "
                             "local optimizer: remove dgc from the sbc config")
        for o in self.policy.layers:
            if o.selection is not None:
                raise ValueError(f"policy.layers[].selection={o.selection!r}: sbc picks each sign's top-k "
                                 "exactly (torch.topk); remove selection from the override")
        return self


class DecentralizedConfig(MethodConfig):
    """Decentralized training (Tang et al., NeurIPS 2018), no allreduce: each worker mixes models with
    its neighbours (ring by default), sending messages to them only. dcd: compressed differences (minmax); ecd:
    compressed extrapolations (grid); dpsgd: uncompressed D-PSGD; naive: compressed models (fails)."""
    bits: Literal[8, 4, 2] = Field(8, description="8 | 4 | 2 bits per element (minmax, grid)")
    quantizer: Literal["minmax", "grid", "topk", "none"] = Field(
        "minmax", description="minmax (relative error: dcd, naive) | grid (absolute error: ecd) | topk | none")
    step: float = Field(0.01, gt=0, description="grid: spacing; beyond +-step*(2**(bits-1)-1) values are clipped")
    density: float = Field(0.1, description="topk: fraction of elements sent, in (0, 1]")
    unbiased: bool = Field(True, description="topk: random-k scaled by n/k (unbiased) or plain top-k (biased)")
    topology: Any = Field("ring", description="ring | N x N mixing matrix (list of lists) | path to a YAML file")
    seed: int = Field(0, description="seed of the stochastic rounding (combined with the rank)")

    strategy: ClassVar[Literal["exchange", "decentralized"]] = "decentralized"
    frameworks: ClassVar[tuple] = ("torch",)
    engines: ClassVar[tuple] = ("horovod",)

    @field_validator("density")
    @classmethod
    def _density(cls, v):
        return check_density(v)

    def limits(self) -> str:
        return ("is decentralized (each worker averages models with its ring neighbours; there is "
                "no averaged gradient)")


DECENTRALIZED = ("dcd", "ecd", "dpsgd", "naive")


# -- parsing ------------------------------------------------------------------------------
class CompressionError(ValueError):
    """A bad ``compression`` section; ``paths``: the dotted keys it is about, so the message can
    name where each came from (the YAML file, a base: file, or --set)."""

    def __init__(self, message: str, paths=()):
        super().__init__(message)
        self.paths = list(paths)


def parse_compression(value: Any) -> MethodConfig:
    """dict (YAML section) or config object -> validated config object: a CompressionConfig for the
    gradient exchange's methods, a DecentralizedConfig for dcd, ecd, dpsgd and naive."""
    if isinstance(value, MethodConfig):
        return value
    if not isinstance(value, dict):
        raise CompressionError(f"compression must be a mapping like {{'method': 'topk', 'density': 0.01}}, "
                               f"got {value!r}", ["compression"])
    method = value.get("method", "none")
    if method not in registry.METHODS:
        guess = closest(str(method), method_names())
        hint = f"; did you mean {guess!r}?" if guess else ";"
        raise CompressionError(f"compression.method={method!r} is unknown{hint} choose one of "
                               f"{', '.join(method_names())}", ["compression.method"])
    cls = registry.config_class(method)
    moved = [k for k in value if k in MOVED and k not in cls.model_fields]
    if moved:
        raise CompressionError("; ".join(f"compression.{k} moved to compression.{MOVED[k]} "
                                         f"(write {_nested_example(MOVED[k], value[k])})" for k in moved),
                               [f"compression.{k}" for k in moved])
    try:
        return cls.model_validate({**value, "method": method})
    except ValidationError as exc:
        problems = [_problem(err, cls, method) for err, _ in relevant(exc.errors())]
        raise CompressionError("; ".join(text for text, _ in problems), [path for _, path in problems]) from None


def exchange_every(value: Any, framework: str = "torch", engine: str = "horovod") -> int:
    """Steps between exchanges of the method ``value`` (dict or config) as it runs under this
    framework and engine: ``local_steps`` once ``auto`` is settled, 1 for an exchange every step."""
    config = parse_compression(value if value is not None else {"method": "none"})
    if hasattr(config, "settle"):
        config = config.settle(framework, engine)
    return int(getattr(config, "local_steps", 1)) if config.delayed else 1


def _nested_example(path: str, value: Any) -> str:
    group, key = path.split(".")
    return f"{group}: {{{key}: {value!r}}}"


def _problem(err: dict, cls: type, method: str) -> tuple:
    """(one error's text, the dotted key it is about)."""
    path = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
    loc = ".".join(["compression", *path])
    if err["type"] == "extra_forbidden":
        group = dotted(["compression", *path[:-1]])
        owner = f"{group} with method: {method}"
        return unknown_key(group, path[-1], _valid_keys(cls, path[:-1]), owner=owner), loc
    if err["type"] == "missing":
        return f"{dotted(['compression', *path])}: required, and not given", loc.rpartition(".")[0]
    return f"{dotted(['compression', *path])}: {plain(err['msg'])}", loc


def _valid_keys(cls: type, path: list) -> list:
    """The keys of the group at ``path`` (a key of a list entry: its element type's)."""
    for part in path:
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            if part.isdigit():
                continue
            return []
        cls = field.annotation
        args = [a for a in getattr(cls, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
        cls = args[0] if args else cls
    if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
        return []
    return sorted(cls.model_fields)
