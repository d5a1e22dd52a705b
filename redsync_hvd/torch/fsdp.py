"""RedSync under FSDP2 (``fully_shard``): a compressed reduce-scatter for every parameter group.

    for layer in model.layers: fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)      # on the sharded parameters
    state = redsync_hvd.torch.fsdp.register(model, compression={"method": "redsync", "density": 0.01},
                                            optimizer=opt)
    ... train as usual; state.communication_stats(); state.state_dict() (one per rank)

FSDP2 reduces each group's gradients in one reduce-scatter of a flat buffer;
``FSDPModule.set_custom_reduce_scatter`` lets ``register`` replace it, on every FSDP module under
the model, with :class:`~redsync_hvd.exchange.sharded.ShardedGroup`'s: the flat gradient is
compensated with this rank's residual, exactly k per shard piece travel to their owners by the
sparse reduce-scatter's alltoall, each owner adds up all it received and its own row, and the
residual keeps what was not sent. Groups whose parameters all go dense (the policy's
``min_compress_numel`` or cost model, as in the other engines) take FSDP's reduce-scatter.

A step: FSDP calls the reduce-scatter once per group during backward (in reverse order of the
forward, the same on every rank); the first call of a backward queues a callback that runs when
backward ends, after FSDP's own: one allreduce of every group's non-finite flag (and of the
runner's stop flags, ``carry``); all finite, every group's new residual is committed; else they
are all dropped and backward raises :class:`~redsync_hvd.exchange.NonFiniteGradientError` on
every rank, with the residuals as they were.

``op`` is honoured: ``AVG`` divides the sum by N; ``SUM`` leaves FSDP its post-divide (as with
``MixedPrecisionPolicy(reduce_dtype=torch.float16)`` or ``set_force_sum_reduction_for_comms``).
The reduce dtype's gradient is read as it is (bf16 included); residuals stay fp32, or bf16 with
``compression.residual_dtype: bf16``. FSDP does not call the reduce-scatter on one rank.

Momentum correction (DGC) works as under the DDP hook (``optimizer=`` is needed: its momentum
and weight decay move into the compression state and it then steps plain SGD): the velocity
has the unsharded group's size, next to the residual; the weight decay, whose weights only the
owner holds, joins the owner's own row times N (the sum over ranks of each rank's ``wd * w``).
Every parameter of one group shares one momentum.

With ``local_steps: auto`` (RedSync's default) the exchange runs every step and RedSync's
positions travel Golomb-coded, each owner's share as places in its shard
(``AllgatherConfig.settle``); under torch.optim.SGD the values travel as int8 codes, and the
layers that go dense as int8 codes under any optimizer.

Refused, with the engine that runs it named: SBC, the decentralized methods, PowerSGD, IWP and
the other allreduce methods (``engine.refuse``); ``policy.mode: budget`` and ``dgc.clip_norm``
(here); HSDP meshes and custom divide factors (``PREMUL_SUM``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..comm.torch_dist import TorchDistCommunicator
from ..compressors.base import Layer
from ..core.stats import CommStats
from ..engine import (
    NO_MOMENTS_NOTE,
    NO_MOMENTUM_NOTE,
    check_same_everywhere,
    given_compute,
    network_for,
    parse,
    probe_compute,
    refuse,
    refuse_average_variance,
)
from ..engine.decisions import pin
from ..exchange import NonFiniteGradientError
from ..exchange.sharded import KINDS, Settings, ShardedGroup, message_format
from ..memory.state import Carried
from ..policy import LayerPolicy
from ..policy.costmodel import sharded_group_time
from .params import take_momentum
from .sharding import load_local_state, local_state, shard

DENSE_BYTES = {"fp32": 4, "fp16": 2, "int8": 1}   # a dense parameter's bytes an element on the wire (int8: codes)

__all__ = ["FSDPCompressionState", "load_local_state", "local_state", "register", "shard"]


@dataclass
class StepEnd:
    """A finished step as the runner reads it (``carrier().last``): the carried flags summed."""
    carried: list | None


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter hook for one group: hands the call to the state (synchronous: FSDP
    reads the output right after the call returns)."""

    def __init__(self, state: "FSDPCompressionState", index: int):
        self.state, self.index = state, index

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.state.reduce_scatter(self.index, output_tensor, input_tensor, op)
        return None


class FSDPCompressionState:
    """What :func:`register` returns: the groups, their step transaction, and the accessors the
    DDP hook's state offers (``communication_stats``, ``layer_decisions``, ``set_steps_per_epoch``,
    ``state_dict``/``load_state_dict``); it is also the runner's carrier of the stop flags."""

    def __init__(self, config, comm, groups: list, policy: LayerPolicy, extras: list, carried: Carried):
        self.config, self.comm, self.groups, self.policy = config, comm, groups, policy
        self.carried = carried          # every group's buffers: one commit when backward ends, or one rollback
        self.extras = extras            # per group: (() -> factor of a SUM, () -> wd * w of the own row, or None)
        self.stats = CommStats()
        self.steps = 0
        self.carry = None               # the runner's flags: carry() -> [float, ...]
        self.last: StepEnd | None = None
        self._pending: list = []        # (group, GroupStep) of this backward
        self._open = False
        self._failed: BaseException | None = None
        self._scratch: dict = {}

    @property
    def exchange(self):
        """The runner's carrier (``TorchTrainer.carrier``): this state."""
        return self

    # -- the step ---------------------------------------------------------------------------------
    def reduce_scatter(self, index: int, output: torch.Tensor, grad: torch.Tensor, op) -> None:
        """One group's reduce-scatter (module docstring); the first of a backward opens the step."""
        group = self.groups[index]
        if not self._open:
            self._open, self._failed, self._pending = True, None, []
            Variable._execution_engine.queue_callback(self._end_step)
            self.densities()
        try:
            average = self._average(op)
            if grad.numel() != group.layout.numel or output.numel() != group.layout.row:
                raise ValueError(f"FSDP group {group.name!r} handed a reduce-scatter of {grad.numel()} -> "
                                 f"{output.numel()} elements; register() laid it out as {group.layout.numel} -> "
                                 f"{group.layout.row}. Call register() after fully_shard and keep every parameter "
                                 "trainable (or freeze it before register())")
            factor, decay = self.extras[index]
            result = group.reduce_scatter(output, grad, self.steps, average, self.comm.size if average else factor(),
                                          decay() if decay is not None else None, self._scratch_buffer)
        except BaseException as exc:   # backward stops here on every rank; the next one opens a new step
            self._failed, self._open, self._pending = exc, False, []
            output.fill_(float("nan"))
            raise
        self._pending.append((group, result))

    def _average(self, op) -> bool:
        if op == dist.ReduceOp.AVG:
            return True
        if op == dist.ReduceOp.SUM:
            return False
        raise ValueError(f"FSDP asked for a reduce-scatter with op {op}; the compressed reduce-scatter sums or "
                         "averages: leave FSDP's gradient divide factor at its default (set_gradient_divide_factor "
                         "uses PREMUL_SUM)")

    def _scratch_buffer(self, key: str, numel: int) -> torch.Tensor:
        """fp32 work buffers for bf16 storage, one per kind, as large as the largest group."""
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = torch.empty(numel, dtype=torch.float32, device=self.groups[0].device)
        return buf[:numel]

    def _end_step(self) -> None:
        """When backward ends: one allreduce of the non-finite flags and the carried values;
        commit every group, or roll every group back and raise on every rank."""
        pending, self._pending, self._open = self._pending, [], False
        if self._failed is not None:
            self.carried.rollback()
            return   # a call of this backward raised: nothing of this step is kept, no collective
        carry = [float(v) for v in self.carry()] if self.carry is not None else []
        sums = [0.0]
        if carry or any(g.settings.check_finite for g, _ in pending):   # else nothing to agree on
            bad = torch.stack([r.bad.to(torch.float32).reshape(()).cpu() for _, r in pending]).sum() if pending \
                else torch.zeros(())
            sums = self.comm.wait(self.comm.allreduce_async(torch.cat([bad.reshape(1),
                                                                       torch.tensor(carry, dtype=torch.float32)]),
                                                            name="fsdp.step", average=False)).tolist()
        if sums[0] > 0:
            self.carried.rollback()
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN/Inf) at step {self.steps} on {int(sums[0])} FSDP group(s) of some "
                "rank: the residuals and velocities stay as they were. Lower the learning rate, clip "
                "gradients or check the input data. This check is on by default where the method keeps a residual (a "
                "NaN there would stay for good); compression.check_finite=false passes NaN/Inf on instead")
        self.carried.commit()
        for group, result in pending:
            self.stats.add_bytes(result.kinds, group.kind)
            self.stats.add("bytes_received", result.received)
            self.stats.add("dense_bytes", result.dense)
        if carry:
            self.stats.add_bytes({"scalars": 4 * len(carry)})
        self.stats.end_step()
        self.steps += 1
        self.last = StepEnd(sums[1:] if carry else None)

    # -- accessors --------------------------------------------------------------------------------
    def communication_stats(self) -> dict:
        """Cumulative per-rank figures since start: ``wire_bytes`` this rank put into the
        reduce-scatters (its share for the other ranks), ``bytes_received``, ``dense_bytes`` what
        FSDP's own reduce-scatter of the same buffers would have handed over."""
        out = self.stats.summary()
        out["last_step"] = dict(getattr(self.stats, "last", {}))
        out["layers"] = {l.name: {"group": g.name, "compressed": l.compressed, "numel": l.numel}
                         for g in self.groups for l in g.layers}
        return out

    def layer_decisions(self) -> list:
        """The policy's decisions, with each parameter's FSDP group and how that group travels."""
        groups = {l.name: g for g in self.groups for l in g.layers}
        out = []
        for d in self.policy.decisions:
            g = groups[d["name"]]
            how = "exactly k per shard piece (radix selection), to the shard's owner" if d["compressed"] else \
                g.wire.how(alone=not g.compressed)
            out.append({**d, "fsdp_group": g.name, "aggregation": f"FSDP reduce-scatter of group {g.name}",
                        "aggregation_why": how})
        return out

    def decision_record(self) -> dict:
        record = self.policy.record()
        record["layers"] = self.layer_decisions()
        return record

    def set_steps_per_epoch(self, steps: int) -> None:
        self.policy.steps_per_epoch = steps

    def set_grad_scaler(self, scaler) -> None:
        if scaler.is_enabled():
            raise ValueError("engine: fsdp with a GradScaler (fp16 autocast): FSDP2's gradients arrive scaled per "
                             "group and a skipped step would need every group's residual back; train with "
                             "training.precision: bf16 (no scaler) or fp32")

    def densities(self) -> None:
        """Every layer's density at this step (the policy's warm-up)."""
        for g in self.groups:
            for l in g.layers:
                l.density = self.policy.density(l, self.steps)

    def state_dict(self) -> dict:
        """This rank's residuals and velocities per group (per rank: save one per rank)."""
        return {"method": self.config.method, "world_size": self.comm.size, "steps": self.steps,
                "stats": self.stats.state_dict(), "policy": self.policy.state_dict(),
                "groups": {g.name: {k: v.detach().clone() for k, v in g.buffers().items()} for g in self.groups}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("method") != self.config.method or state.get("world_size") != self.comm.size:
            raise ValueError(f"this compression state was saved with method {state.get('method')!r} on "
                             f"{state.get('world_size')} workers, but FSDP runs {self.config.method!r} on "
                             f"{self.comm.size}: resume with the same compression config and world size")
        saved = state["groups"]
        mine = {g.name for g in self.groups}
        if set(saved) - mine:
            raise ValueError(f"the saved compression state has FSDP groups {sorted(set(saved) - mine)[:5]} that this "
                             "model lacks: resume with the same model and fully_shard wrapping")
        for g in self.groups:
            g.load(saved.get(g.name, {}))
        self.steps = int(state["steps"])
        self.stats.load_state_dict(state["stats"])
        self.policy.load_state_dict(state.get("policy", {}))


AUTO_NOTE = ("compression.local_steps: 1 (auto): each rank's optimizer steps only its own shards, so FSDP2 "
             "exchanges every step; positions travel {coding} (golomb: each owner's share as places in its shard), "
             "values as {values} (int8 under torch.optim.SGD) and the layers that go dense as {dense} (int8: codes "
             "whose rounding the residual keeps); set "
             "local_steps: 1 to keep the message as given; docs/fsdp.md")


def register(model, compression=None, optimizer=None, communicator=None) -> FSDPCompressionState:
    """Set the compressed reduce-scatter on every FSDP module under ``model``; return its state.

    1. parse the config; refuse what a reduce-scatter cannot carry, naming the engine that runs it;
    2. every FSDP module's parameter group, in module order, and the parameters' names;
    3. every rank agrees on config and layers (one allgather); momentum correction takes the
       optimizer's momentum and weight decay;
    4. the policy decides per parameter (and, with the cost model, per group);
    5. each module gets its reduce-scatter (and reduces unused parameters too, so that every
       step's buffer has the same layout).

    compression: a dict like the YAML ``compression:`` section or a config object. optimizer: the
    optimizer built on the sharded parameters (needed for momentum correction).
    communicator: the collectives to use (default: torch.distributed over FSDP's group)."""
    config = parse(compression)
    auto = getattr(config, "local_steps", None) == "auto"
    if auto:   # every step here; RedSync's positions Golomb-coded (AllgatherConfig.settle)
        config = config.settle("torch", "fsdp", sgd=isinstance(optimizer, torch.optim.SGD))
    refuse(config, "torch", "fsdp")
    modules = _groups(model)
    comm = communicator or TorchDistCommunicator(modules[0][2].mesh_info.shard_process_group)
    names = {id(p): n for n, p in model.named_parameters()}
    layers, per_group = [], []
    for name, _, pg in modules:
        params = [fp for fp in pg.fsdp_params if fp.sharded_param.requires_grad]
        mine = [Layer(names[id(fp.sharded_param)], tuple(fp._orig_size), math.prod(fp._orig_size), len(layers) + i,
                      fp.sharded_param.device) for i, fp in enumerate(params)]
        layers += mine
        per_group.append((name, params, mine, pg))
    check_same_everywhere(comm, config, layers)                                              # 3.
    spec = _momentum(config, optimizer, {fp.sharded_param: l.name for _, ps, ls, _ in per_group
                                         for fp, l in zip(ps, ls)})
    policy = _decide(config, layers, per_group, comm)                                        # 4.
    if config.corrects_momentum and spec is None:   # Adam, AdamW: plain residuals (momentum 0 below)
        policy.notes = [NO_MOMENTUM_NOTE]
    adam = isinstance(optimizer, torch.optim.Adam)   # auto is silent under any other optimizer
    if config.in_update_units and spec is None and (config.feedback_units == "update" or adam):
        # (under SGD, DGC's correction already is update units)
        policy.notes.append(NO_MOMENTS_NOTE.format(why="engine: fsdp would keep them for every whole layer on "
                                                       "every worker, which is what sharding exists to avoid"))
    if auto:
        policy.notes.append(AUTO_NOTE.format(coding=_index_coding(config), dense=_dense_values(config),
                                             values=getattr(getattr(config, "message", None), "quantize", "fp32")))
    refuse_average_variance(config, "engine: fsdp keeps no Adam moments per worker")
    groups, extras, carried = [], [], Carried(KINDS)
    for name, params, mine, pg in per_group:
        groups.append(_group(config, name, params, mine, comm, spec, carried))
        extras.append((lambda pg=pg: _sum_factor(pg), _decay(params, mine, spec)))
    state = FSDPCompressionState(config, comm, groups, policy, extras, carried)
    for index, (_, module, _) in enumerate(modules):                                         # 5.
        module.set_reduce_scatter_unused_params(True, recurse=False)
        module.set_custom_reduce_scatter(CompressedReduceScatter(state, index))
    return state


def _groups(model) -> list:
    """(name, module, its one parameter group) of every FSDP module under ``model`` that reduces
    something. Raises on a model without fully_shard, or with HSDP / per-parameter meshes."""
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        pgs = module._get_fsdp_state()._fsdp_param_groups
        if len(pgs) > 1:
            raise ValueError(f"FSDP module {name or '<root>'!r} has {len(pgs)} parameter groups (per-parameter "
                             "meshes); register() needs one group per module: drop shard_placement_fn's meshes")
        if pgs and any(fp.sharded_param.requires_grad for fp in pgs[0].fsdp_params):
            if pgs[0].mesh_info.mesh.ndim != 1:
                raise ValueError("register() runs FSDP on a 1-D mesh; HSDP (replicate x shard) adds an allreduce "
                                 "the compressed reduce-scatter does not carry: use a 1-D mesh")
            out.append((name or "<root>", module, pgs[0]))
    if not out:
        raise TypeError(f"register() needs a model with fully_shard applied (FSDP2), got {type(model).__name__} "
                        "without trainable FSDP parameters: call fully_shard on its layers and on the model first")
    return out


def _momentum(config, optimizer, names: dict):
    """Momentum correction: the optimizer's momentum and weight decay, moved out of it (None
    without momentum correction, or for an optimizer without momentum: Adam, AdamW)."""
    if not config.corrects_momentum:
        return None
    if optimizer is None:
        raise ValueError("compression.dgc.momentum_correction keeps the optimizer's momentum in the compression "
                         "state: pass optimizer=<the optimizer built on the sharded parameters> (its momentum and "
                         "weight decay move into the state), or set dgc: {momentum_correction: false}")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for p, n in names.items() if id(p) not in held]
    if missing:
        raise ValueError(f"optimizer does not hold the sharded parameters {missing[:5]}: build the optimizer on "
                         "model.parameters() after fully_shard, then call register()")
    return take_momentum(optimizer.param_groups, names)


def _decide(config, layers: list, per_group: list, comm) -> LayerPolicy:
    """The policy's per-parameter decisions; with ``policy.mode: cost_model``, each group whose
    compressed reduce-scatter the model predicts slower than FSDP's dense one goes dense."""
    policy = LayerPolicy(config)
    if not config.uses_memory:   # method none: FSDP's own reduce-scatter for every group, counted
        policy.setup(layers, comm.size)
        for l, d in zip(layers, policy.decisions):
            l.compressed = False
            d.update(compressed=False, density=1.0, why=f"method {config.method}")
        return policy
    network = None
    if getattr(config, "policy", None) is not None and config.policy.decisions is not None:
        network, policy.compute = pin(policy, config, comm)
    elif getattr(config, "policy", None) is not None:
        network = network_for(config, comm)
        if network is not None:
            policy.compute = given_compute(config) or probe_compute(comm, layers[0].device)
    if network is not None and policy.pinned is None:   # priced per group below, not per layer
        cheap = config.model_copy(update={"policy": config.policy.model_copy(update={"mode": "static"})})
        policy.config = cheap
        policy.setup(layers, comm.size, network)
        policy.config, policy.source = config, "cost model, per FSDP group"
        _price_groups(policy, per_group, comm.size, network)
    else:
        policy.setup(layers, comm.size, network)
    return policy


def _quantize(config, layer) -> str:
    """The layer's message.quantize (policy.layers may give one per layer)."""
    return layer.quantize or getattr(getattr(config, "message", None), "quantize", "none")


def _dense_values(config) -> str:
    """``policy.dense_values``: how the dense parameters travel (fp32, fp16, or int8 codes)."""
    return getattr(getattr(config, "policy", None), "dense_values", "fp32")


def _index_coding(config) -> str:
    return getattr(getattr(config, "message", None), "index_coding", "raw")


def _price_groups(policy: LayerPolicy, per_group: list, size: int, network) -> None:
    for name, _, mine, _ in per_group:
        shapes = [(l.numel, l.base_density if l.compressed else None,
                   message_format(_quantize(policy.config, l), _index_coding(policy.config))) for l in mine]
        compressed, dense = sharded_group_time(shapes, size, network, policy.compute,
                                               DENSE_BYTES[_dense_values(policy.config)])
        keep = compressed < dense and any(l.compressed for l in mine)
        why = (f"cost model: group {name} compressed {compressed * 1e3:.3f} ms vs FSDP's dense reduce-scatter "
               f"{dense * 1e3:.3f} ms")
        for l in mine:
            d = next(d for d in policy.decisions if d["name"] == l.name)
            if l.compressed and not keep:
                l.compressed = False
                d.update(compressed=False, density=1.0, why=why)
                d.pop("quantize", None)
            elif l.compressed:
                d["why"] = why


def _group(config, name: str, params: list, mine: list, comm, spec, carried: Carried) -> ShardedGroup:
    """One group's reduce-scatter: its message format (one per group), momentum (one per group)."""
    quantize = {_quantize(config, l) for l in mine if l.compressed}
    if len(quantize) > 1:
        raise ValueError(f"FSDP group {name!r} mixes message.quantize {sorted(quantize)} across its parameters "
                         f"({[l.name for l in mine]}); one reduce-scatter carries one message format: give its "
                         "parameters one quantize in policy.layers, or fully_shard them apart")
    momentum = {spec.momentum.get(l.name, 0.0) for l in mine} if spec is not None else {0.0}
    if len(momentum) > 1:
        raise ValueError(f"FSDP group {name!r} has parameters with momenta {sorted(momentum)}; momentum correction "
                         "applies one momentum per group: put them in one optimizer param group, or fully_shard "
                         "them apart")
    masking = getattr(getattr(config, "dgc", None), "momentum_masking", True)
    if masking == "stale":
        raise ValueError(f"FSDP group {name!r}: dgc.momentum_masking: stale is not implemented for FSDP2's sharded "
                         "residuals (its kernel masks every position sent); set momentum_masking to true or false")
    settings = Settings(momentum=momentum.pop(), nesterov=bool(spec and spec.nesterov), masking=bool(masking),
                        storage=getattr(config, "residual_dtype", "fp32"),
                        backend=getattr(getattr(config, "selection", None), "radix_backend", "auto"),
                        check_finite=config.finite_check, dense_values=_dense_values(config))
    sign_rule = getattr(getattr(config, "message", None), "sign_rule", "alternate")
    return ShardedGroup(name, mine, [math.prod(fp.padded_sharded_param_size) for fp in params], comm, settings,
                        quantize.pop() if quantize else "none", sign_rule, params[0].sharded_param.device, carried,
                        _index_coding(config))


def _sum_factor(pg) -> float:
    """What FSDP divides a SUM reduce-scatter's output by afterwards (its post-divide factor; FSDP
    knows its reduce dtype from the first forward on)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
    reduce_dtype = getattr(pg, "_reduce_dtype", None) or pg.fsdp_params[0].sharded_param.dtype
    _, post, _, _ = _get_gradient_divide_factors(pg._reduce_scatter_process_group, None, reduce_dtype,
                                                 pg.device.type, pg.gradient_divide_factor,
                                                 pg.force_sum_reduction_for_comms)
    return float(post or 1.0)


def _decay(params: list, mine: list, spec):
    """Momentum correction with weight decay: a callable giving wd * w of this rank's shard of the
    group (fp32, the row's layout), or None."""
    if spec is None or not any(spec.weight_decay.get(l.name, 0.0) for l in mine):
        return None
    wds = [float(spec.weight_decay.get(l.name, 0.0)) for l in mine]
    return lambda: torch.cat([fp._sharded_param_data.detach().float() * wd for fp, wd in zip(params, wds)])
