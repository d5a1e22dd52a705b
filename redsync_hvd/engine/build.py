"""One adapter core: build the gradient exchange for any framework and engine.

Adapters (``redsync_hvd.torch``, ``redsync_hvd.tensorflow``, the DDP hook) describe their
parameters as :class:`~redsync_hvd.compressors.base.Layer` objects, bring a communicator, and
call :func:`build_exchange`, which

    1. parses the compression (a dict like the YAML section, a config object, or a Compressor);
    2. refuses what this framework or engine cannot run, naming what can;
    3. has every rank agree on config and layers (one allgather) before any other collective;
    4. builds the memory: residuals, or DGC momentum correction with the momentum (and weight
       decay) taken out of the wrapped optimizer through the adapter's ``take_momentum``; an
       optimizer without momentum (``take_momentum`` gives None: Adam, AdamW) keeps plain
       residuals, or with ``feedback_units: update`` each worker's own Adam moments (read through
       ``take_moments``: the residual then holds Adam steps), and the run's decisions say so (``notes``);
    5. makes the per-layer decisions, probing network and compute where the cost model needs them,
       or takes them from ``policy.decisions`` (engine/decisions.py: pinned, nothing probed);
    6. builds the exchange.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from ..compressors import Compressor, build_compressor
from ..config.compression import (
    CompressionConfig,
    MethodConfig,
    method_names,
    parse_compression,
)
from ..exchange import GradientExchange
from ..memory import AdamUnitsMemory, MomentumCorrectionMemory, ResidualMemory
from ..policy import LayerPolicy
from ..policy.costmodel import ComputeModel
from .decisions import pin
from .probes import given_compute, network_for, probe_compute, probe_overlap


class UnsupportedMethodError(ValueError, NotImplementedError):
    """This framework or engine cannot run the method; the message names what can."""


@dataclass
class MomentumSpec:
    """What DGC's momentum correction takes out of the wrapped optimizer, per layer name."""
    momentum: dict = field(default_factory=dict)
    nesterov: bool = False
    weight_decay: dict = field(default_factory=dict)


@dataclass
class AdamSpec:
    """What error feedback in update units reads of an Adam or AdamW optimizer, per layer name:
    (b1, b2), eps, and Adam's coupled weight decay as (decay, parameter)."""
    betas: dict = field(default_factory=dict)
    eps: dict = field(default_factory=dict)
    l2: dict = field(default_factory=dict)


@dataclass
class Built:
    exchange: GradientExchange
    config: CompressionConfig
    momentum: Optional[MomentumSpec] = None   # set when momentum correction took it out
    moments: Optional[AdamSpec] = None        # set when the residuals hold update units (Adam, AdamW)


def parse(compression: Any) -> MethodConfig:
    """The config of a dict, a config object or a Compressor (dense fp32 for None)."""
    if isinstance(compression, Compressor):
        return build_compressor(compression)[1]
    return parse_compression(compression if compression is not None else {"method": "none"})


def refuse(config: MethodConfig, framework: str, engine: str) -> None:
    """Stop, naming the alternatives, when this framework or engine cannot run the method."""
    if framework not in config.frameworks:
        able = [m for m in method_names() if framework in parse_compression({"method": m}).frameworks]
        raise UnsupportedMethodError(f"compression.method={config.method!r} {config.limits()}; the {framework} "
                                     f"adapter exchanges gradients. Use framework: torch for {config.method}, or "
                                     f"one of {', '.join(able)}")
    if config.updates_in_step and (framework, engine) != ("torch", "horovod"):
        where = f"the {framework} adapter" + (f" under engine: {engine}" if engine != "horovod" else "")
        raise ValueError("compression.sparse_update updates the weights inside "
                         f"redsync_hvd.torch.DistributedOptimizer's step(); {where} writes dense averaged "
                         "gradients. Set sparse_update: false")
    if config.follows_own_lr and (framework, engine) != ("torch", "horovod"):
        raise ValueError("compression.residual_lr: own follows the learning rate of "
                         "redsync_hvd.torch.DistributedOptimizer's param_groups (PyTorch under horovodrun); "
                         f"the {framework} adapter under engine: {engine} does not pass it: set residual_lr: send")
    if engine not in config.engines:
        able = [m for m in method_names() if engine in parse_compression({"method": m}).engines]
        if engine == "fsdp":
            raise UnsupportedMethodError(
                f"compression.method={config.method!r} {config.sharded_limits or config.limits()}, which FSDP's "
                "reduce-scatter (one sum per shard, once per step) cannot carry: run it with engine: "
                f"{' or engine: '.join(config.engines)}. Under engine: fsdp use one of {', '.join(able)}")
        raise UnsupportedMethodError(f"compression.method={config.method!r} {config.limits()}, which a "
                                     f"{engine} communication hook cannot run: use the Horovod engine "
                                     "(redsync_hvd.torch.DistributedOptimizer under horovodrun, or engine: horovod "
                                     f"in python -m redsync_hvd.train). Under engine: {engine} use one of "
                                     f"{', '.join(able)}")
    dense = getattr(getattr(config, "policy", None), "dense_values", "fp32")
    if engine == "fsdp" or getattr(config, "residual_dtype", "fp32") != "fp32" or dense == "int8":
        refuse_sharded(config, engine)


def refuse_sharded(config: MethodConfig, engine: str) -> None:
    """What engine: fsdp's compressed reduce-scatter (exchange/sharded.py) does not do (the
    config names it: ``sharded_problems``), and what only it does anywhere else:
    ``residual_dtype: bf16`` and ``policy.dense_values: int8``."""
    if engine != "fsdp" and getattr(getattr(config, "policy", None), "dense_values", "fp32") == "int8":
        raise ValueError(f"compression.policy.dense_values: int8 sends the dense layers as codes by FSDP2's "
                         f"alltoall (engine: fsdp); engine: {engine} sums them in an allreduce, which cannot add codes "
                         "of different scales: set dense_values: fp16 or fp32")
    if engine != "fsdp":
        raise ValueError(f"compression.residual_dtype: {config.residual_dtype} stores the residuals of engine: fsdp; "
                         f"engine: {engine} keeps them in fp32: set residual_dtype: fp32")
    for what, fix in config.sharded_problems().items():
        raise UnsupportedMethodError(f"compression.{what} under engine: fsdp: {fix}, or train with engine: ddp")


def check_same_everywhere(comm, config: CompressionConfig, layers: list) -> None:
    """Ranks must agree on config and layer list before the first collective, or they would hang."""
    mine = json.dumps({"compression": config.model_dump(mode="json"),
                       "layers": [(l.name, list(l.shape)) for l in layers]}, sort_keys=True)
    everyone = comm.allgather_object(mine, name="rsync.config_check")
    if any(other != mine for other in everyone):
        bad = [r for r, other in enumerate(everyone) if other != everyone[0]]
        raise ValueError(f"ranks {bad} have a different compression config or model than rank 0; "
                         "every rank must build the same model and pass the same compression settings")


NO_MOMENTUM_NOTE = ("compression.dgc.momentum_correction: the wrapped optimizer has no momentum (Adam, AdamW: no "
                    "'momentum' in its param groups), so the residual holds gradients (plain error feedback) and "
                    "the optimizer keeps its moments and weight decay (docs/redsync.md, Adam and AdamW)")


def without_momentum_correction(config: MethodConfig) -> MethodConfig:
    """``config`` with DGC's momentum correction off: what runs when the optimizer has no momentum
    for it to take (``take_momentum`` gave None). Momentum correction is derived for SGD's
    velocity (Lin et al., 2018); Adam normalises each coordinate by its own second moment, and
    moving AdamW's decoupled decay into the residual would make it L2 on the gradient."""
    dgc = config.dgc.model_copy(update={"momentum_correction": False})
    return config.model_copy(update={"dgc": dgc})


NO_MOMENTS_NOTE = ("compression.feedback_units: update needs each worker's own Adam moments, but {why}: the "
                   "residual holds gradients (docs/redsync.md, Adam and AdamW)")


UPDATE_UNITS_NOTE = ("compression.feedback_units: update: each worker keeps its own Adam moments of the compressed "
                     "layers and its residual holds its own Adam steps; the compressed layers move by lr times the "
                     "average sent (plus AdamW's decoupled decay), the dense ones by the optimizer's own Adam "
                     "(docs/redsync.md, Adam and AdamW)")


def auto_notes(config: MethodConfig) -> list:
    """layers.log lines for the ``auto`` settings the cost model set other than a static policy would."""
    selection = getattr(config, "selection", None)
    if selection is None or not getattr(selection, "reuse_chosen", False) or config.policy.mode != "cost_model":
        return []
    r = selection.threshold_reuse
    if getattr(config, "delayed", False) and r == 1:   # settle's rule 8
        return ["compression.selection.threshold_reuse: 1 (auto under local steps): each exchange of local steps "
                "searches each layer's threshold afresh; a round's delta seldom keeps the last one's count "
                "(docs/redsync.md, 'Local steps')"]
    return [f"compression.selection.threshold_reuse: {r} (auto under policy.mode: cost_model): each layer's "
            f"threshold is searched every {r} steps and only counted in between (docs/redsync.md)"]


def update_units(config: MethodConfig, take_moments: Optional[Callable[[], Union[AdamSpec, str, None]]],
                 where: str, why: Optional[str] = None) -> tuple:
    """(the Adam spec, notes) for ``feedback_units: update`` or ``auto`` once momentum correction has
    had its say: under SGD DGC's correction already is error feedback in update units, so nothing
    changes. ``take_moments`` gives the spec, None (not Adam) or why an Adam step cannot be
    reproduced; ``auto`` notes only the last (gradient units are any other optimizer's own)."""
    if not config.in_update_units or config.corrects_momentum:
        return None, []
    got = take_moments() if take_moments is not None else None
    if isinstance(got, AdamSpec):
        return got, []
    if config.feedback_units == "auto" and not isinstance(got, str):
        return None, []
    why = why or got or (f"{where} cannot read them from an optimizer (the torch adapter can under engine: horovod, "
                         "and under engine: ddp with register(..., optimizer=))" if take_moments is None else
                         "the optimizer is not torch.optim.Adam or AdamW (a step linear in the gradient needs none)")
    return None, [NO_MOMENTS_NOTE.format(why=why)]


def refuse_average_variance(config, why: str) -> None:
    """``adam_variance: of_average`` where no worker takes Adam steps of its own: a clear error,
    not a key that changes nothing."""
    if getattr(config, "adam_variance", "own") != "own":
        raise ValueError(f"compression.adam_variance: {config.adam_variance} changes the Adam steps each worker "
                         f"takes of its own, and this run keeps none ({why}): leave adam_variance out")


def build_memory(config: CompressionConfig, momentum: Optional[MomentumSpec], fuse: bool = True,
                 moments: Optional[AdamSpec] = None, workers: int = 1):
    """``workers``: the world's size, for ``adam_variance: of_average``."""
    if not config.uses_memory:
        return None
    if moments is not None:
        if getattr(config, "adam_variance", "own").startswith("shared"):
            raise ValueError(f"compression.adam_variance: {config.adam_variance} averages the workers' variances at "
                             "each exchange of local steps, and this run exchanges every step (update units): use "
                             "of_average, or local steps (engine: horovod, local_steps above 1)")
        of_average = getattr(config, "adam_variance", "own") == "of_average"
        return AdamUnitsMemory(moments.betas, moments.eps, moments.l2, freeze_after=config.frozen_variance_after,
                               decay=config.residual_decay, sign_step=config.steps_by_sign,
                               workers=workers if of_average else 1)
    if config.residual_decay != 1.0 or config.steps_by_sign:
        raise ValueError(f"compression.method={config.method!r}: decay and sign_step act on each worker's own Adam "
                         "steps (error feedback in update units), which this run does not keep: train with "
                         "torch.optim.Adam or AdamW under engine: horovod or ddp, or remove decay and sign_step")
    if config.corrects_momentum:
        return MomentumCorrectionMemory(momentum.momentum, nesterov=momentum.nesterov,
                                        masking=config.dgc.momentum_masking, fuse=fuse)
    return ResidualMemory(fuse=fuse)


def compute_model(config, comm, layers: list, device) -> ComputeModel:
    """What a compressed layer costs here, ``c0 + c1 * n``: ``policy.compute_s`` where the config
    gives it (decisions that do not move with the machine's load), else the run's own method
    timed on the model's own smallest and largest candidate layers."""
    given = given_compute(config)
    if given is not None:
        return given
    sizes = [l.numel for l in layers if l.numel >= config.policy.min_compress_numel]
    spec = config.model_dump(mode="json")
    if isinstance(spec.get("selection"), dict):   # the probe runs the run's own reuse, not auto's static one
        spec["selection"]["threshold_reuse"] = config.selection.threshold_reuse
    return probe_compute(comm, device, spec=spec, sizes=sizes or None)


def build_exchange(compression: Any, layers: list, comm, *, framework: str = "torch", engine: str = "horovod",
                   take_momentum: Optional[Callable[[], MomentumSpec]] = None,
                   take_moments: Optional[Callable[[], Optional[AdamSpec]]] = None, agree: bool = True,
                   fuse: bool = True, **options) -> Built:
    """The exchange for ``layers`` (Layer objects) over ``comm``; ``options`` go to GradientExchange
    (reuse_buffers, on_nonfinite). ``take_momentum``: called once, only when the
    config asks for momentum correction; it takes momentum and weight decay out of the optimizer.
    ``take_moments``: called once, only for ``feedback_units: update`` where momentum correction
    does not apply; it reads the Adam optimizer's betas, eps and coupled weight decay (None: no Adam)."""
    config = parse(compression)                                                     # 1.
    chosen = auto_notes(config)
    refuse(config, framework, engine)                                               # 2.
    if config.strategy != "exchange":
        raise ValueError(f"compression.method={config.method!r} {config.limits()}: build it with "
                         "redsync_hvd.torch.DecentralizedOptimizer (DistributedOptimizer does so for you)")
    compressor, config = build_compressor(compression if isinstance(compression, Compressor) else config, comm)
    if agree:
        check_same_everywhere(comm, config, layers)                                 # 3.
    momentum, notes = None, []
    if config.corrects_momentum:                                                    # 4.
        if take_momentum is None:
            raise ValueError("compression.dgc.momentum_correction keeps the optimizer's momentum in the compression "
                             "memory: pass optimizer=<the optimizer that steps the model> (its momentum and weight "
                             "decay move into the memory), or set dgc: {momentum_correction: false}")
        momentum = take_momentum()
        if momentum is None:
            config, notes = without_momentum_correction(config), [NO_MOMENTUM_NOTE]
    moments, more = update_units(config, take_moments, f"the {framework} adapter under engine: {engine}")
    notes = [UPDATE_UNITS_NOTE] if moments is not None else notes + more
    if moments is None and not getattr(config, "delayed", False):
        refuse_average_variance(config, more[0] if more else "this run's optimizer is not Adam or AdamW")
    memory = build_memory(config, momentum, fuse, moments, workers=comm.size)
    policy = LayerPolicy(config, compressor)                                        # 5.
    policy.notes = chosen + notes
    if config.policy.decisions is not None:
        network, policy.compute = pin(policy, config, comm)
    else:
        network = network_for(config, comm)
        if network is not None:
            device = layers[0].device if layers else "cpu"
            policy.compute = compute_model(config, comm, layers, device)
            if config.policy.mode == "cost_model" and config.policy.overlap is None:
                policy.overlap = probe_overlap(comm, sum(l.numel for l in layers), device)
    exchange = GradientExchange(layers, compressor, comm, policy, memory, check_finite=config.finite_check,  # 6.
                                fusion_bytes=config.fusion_bytes, clip_norm=config.local_clip, network=network,
                                cuda_graph=config.cuda_graph, **options)
    exchange.check_finite_unset = config.check_finite is None
    return Built(exchange, config, momentum, moments)
