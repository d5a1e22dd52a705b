"""Drop-in replacement for ``horovod.torch.DistributedOptimizer`` with stateful compression.

Like Horovod, it subclasses the user's optimizer class on the fly, so LR schedulers,
``isinstance`` checks and ``param_groups`` keep working. Gradient hooks
(``register_post_accumulate_grad_hook``) hand each parameter's gradient to the
:class:`~redsync_hvd.exchange.GradientExchange` as soon as backward produces it
(after ``backward_passes_per_step`` passes), so communication overlaps backward.
``step()`` waits for the exchange, writes the averaged gradients into ``.grad``
and runs the wrapped optimizer's update.
"""
from __future__ import annotations

import json
from contextlib import contextmanager

import torch

from ..compressors import build_compressor
from ..exchange import GradientExchange
from ..memory import MomentumCorrectionMemory, ResidualMemory
from ..policy import LayerPolicy
from ..compressors.base import Layer


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compressor, config, backward_passes_per_step, comm):
        super(self.__class__, self).__init__(params)
        self._comm = comm
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        self.backward_passes_per_step = backward_passes_per_step
        named = _resolve_names(named_parameters, self.param_groups)
        self._params = dict(named)
        self._names = {p: n for n, p in named}
        layers = [Layer(n, tuple(p.shape), p.numel(), i, p.device, param=p) for i, (n, p) in enumerate(named)]
        _check_same_everywhere(comm, config, layers)
        memory, self._weight_decay = _build_memory(config, self.param_groups, self._names)
        self._exchange = GradientExchange(layers, compressor, comm, LayerPolicy(config), memory,
                                          check_finite=config.check_finite, fusion_bytes=config.fusion_bytes,
                                          clip_norm=getattr(config, "clip_norm", None),
                                          network=_network(config, comm), grads_writable=True)
        self.compression_config = config
        self._sparse_update = bool(getattr(config, "sparse_update", False))
        if self._sparse_update:
            _check_plain_sgd(self)
        self._passes = {n: 0 for n, _ in named}
        self._synchronized = False
        self._skip_sync = False
        # communication delay (SBC): local steps, then the model delta goes through the exchange
        self._local_steps = getattr(config, "local_steps", None)
        self._snapshot, self._local = None, 0
        self._hooks = [] if self._local_steps else \
            [p.register_post_accumulate_grad_hook(self._make_hook(n)) for n, p in named]

    def _make_hook(self, name):
        def hook(p):
            self._passes[name] += 1
            if self._passes[name] == self.backward_passes_per_step:
                self._exchange.submit(name, self._grad(name, p))
        return hook

    def _grad(self, name, p):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        wd = self._weight_decay.get(name, 0.0)
        # with momentum correction, weight decay joins the gradient before it enters the velocity
        return g.add(p.detach(), alpha=wd) if wd else g

    def set_steps_per_epoch(self, steps: int) -> None:
        """Needed by epoch-based schedules such as ``warmup_epochs``."""
        self._exchange.policy.steps_per_epoch = int(steps)

    def layer_decisions(self) -> list:
        """How each layer travels (compressed or dense, density, and why), decided once at start."""
        return list(self._exchange.policy.decisions)

    def synchronize(self):
        """Finish this step's exchange and write the averaged gradients into ``.grad``."""
        self._synchronize(apply_sparse=False)

    def _synchronize(self, apply_sparse: bool):
        """``apply_sparse`` (``sparse_update``, from ``step()``): layers that travelled sparse are
        decoded straight into their weights as p -= lr * average; their ``.grad`` becomes None
        so the wrapped SGD leaves them alone."""
        for name in self._exchange.missing():
            p = self._params[name]
            self._exchange.submit(name, self._grad(name, p))
        # sparse layers are decoded straight into .grad (no layer-sized copy per step)
        into = {n: p.grad.view(-1) for n, p in self._params.items()
                if p.grad is not None and p.grad.dtype == torch.float32 and p.grad.is_contiguous()
                and not p.grad.is_sparse}
        apply = None
        if apply_sparse:
            apply = {self._names[p]: (p.detach().view(-1), group["lr"]) for group in self.param_groups
                     for p in group["params"] if p in self._names
                     and p.dtype == torch.float32 and p.is_contiguous()}
        try:
            averaged = self._exchange.finish(into=into, apply=apply)
        finally:
            self._passes = dict.fromkeys(self._passes, 0)
        for name in self._exchange.applied:
            self._params[name].grad = None
        for name, flat in averaged.items():
            p = self._params[name]
            if p.grad is not None and flat.data_ptr() == p.grad.data_ptr():
                continue   # already there: decoded or reduced in place
            g = flat.view(p.shape).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()   # the exchange reuses its buffers next step
            else:
                p.grad.copy_(g)
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. to clip gradients) so ``step()`` does not wait again."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def _delayed_step(self, closure):
        """SBC: a local step; every ``local_steps`` steps, exchange W_local - W and restart from
        W + average of the decoded deltas (identical on every rank)."""
        if self._snapshot is None:   # after broadcast_parameters, before the first local step
            self._snapshot = {n: p.detach().clone() for n, p in self._params.items()}
        loss = super(self.__class__, self).step(closure)
        self._local += 1
        ex = self._exchange
        if self._local % self._local_steps:
            # dense SGD would have sent this step's gradients: count them for an honest ratio
            ex.stats.add("dense_bytes", 4 * sum(p.numel() for p in self._params.values()))
            ex.stats.end_step()
            return loss
        for name in ex.order:
            ex.submit(name, self._params[name].detach() - self._snapshot[name])
        averaged = ex.finish()
        with torch.no_grad():
            for name, flat in averaged.items():
                p = self._params[name]
                p.copy_(self._snapshot[name] + flat.view(p.shape).to(p.dtype))
                self._snapshot[name].copy_(p)
        return loss

    def step(self, closure=None):
        if self._local_steps:
            return self._delayed_step(closure)
        if not (self._synchronized or self._skip_sync):
            self._synchronize(apply_sparse=self._sparse_update)
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def communication_stats(self) -> dict:
        """Cumulative per-worker figures since start; see :class:`~redsync_hvd.core.stats.CommStats`."""
        out = self._exchange.stats.summary()
        out["last_step"] = dict(getattr(self._exchange.stats, "last", {}))
        out["layers"] = dict(self._exchange.stats.layers)
        return out

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state["redsync"] = self._exchange.state_dict()
        if self._local_steps:
            state["redsync"]["delay"] = {"local": self._local, "snapshot": self._snapshot}
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("redsync", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if extra is not None:
            delay = extra.pop("delay", None)
            self._exchange.load_state_dict(extra)
            if delay is not None:
                self._local = delay["local"]
                self._snapshot = None if delay["snapshot"] is None else \
                    {k: v.clone() for k, v in delay["snapshot"].items()}


def _build_memory(config, param_groups, names):
    """Residual memory for the method; with DGC momentum correction the wrapper takes
    momentum (and weight decay) out of the wrapped optimizer so they are not applied twice."""
    if not getattr(config, "momentum_correction", False):
        return (ResidualMemory() if config.uses_memory else None), {}
    momentum, decay, nesterov = {}, {}, False
    for group in param_groups:
        for p in group["params"]:
            if p in names:
                momentum[names[p]] = group.get("momentum", 0.0)
                decay[names[p]] = group.get("weight_decay", 0.0)
        nesterov = nesterov or group.get("nesterov", False)
        for key in ("momentum", "weight_decay", "nesterov"):
            if key in group:
                group[key] = False if key == "nesterov" else 0.0
    masking = getattr(config, "momentum_masking", True)
    return MomentumCorrectionMemory(momentum, nesterov=nesterov, masking=masking), decay


def _check_plain_sgd(opt) -> None:
    """``sparse_update`` does the optimizer's job for compressed layers: only right for plain SGD."""
    problems = []
    if not isinstance(opt, torch.optim.SGD):
        problems.append(f"the optimizer is {type(opt).__mro__[1].__name__}, not torch.optim.SGD")
    for i, group in enumerate(opt.param_groups):
        for key in ("momentum", "weight_decay"):
            if group.get(key, 0.0):
                problems.append(f"param group {i} has {key}={group[key]}")
        if group.get("maximize", False):
            problems.append(f"param group {i} has maximize=True")
    if problems:
        raise ValueError("compression.sparse_update applies the averaged sparse gradient straight to the weights, "
                         "which is a plain SGD step, but " + "; ".join(problems) + ". Use torch.optim.SGD with "
                         "momentum_correction: true (it moves momentum and weight decay into the compressor), "
                         "or momentum 0 and weight_decay 0; or set sparse_update: false")


def _network(config, comm):
    if getattr(config, "policy", "static") != "cost_model":
        return None
    from ..costmodel import Network, probe_network
    if config.latency_s is not None and config.bandwidth_gbit is not None:
        return Network.from_config(latency_s=config.latency_s, bandwidth_gbit=config.bandwidth_gbit)
    # each one left out is measured. A probed alpha is Horovod's cost per collective round
    # (its cycle, negotiation, the wait), often far above the link's latency
    probed = probe_network(comm)
    return Network(alpha=probed.alpha if config.latency_s is None else float(config.latency_s),
                   bandwidth=probed.bandwidth if config.bandwidth_gbit is None
                   else float(config.bandwidth_gbit) * 1e9 / 8.0)


def _resolve_names(named_parameters, param_groups):
    params = [p for g in param_groups for p in g["params"] if p.requires_grad]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    names = [n for n, _ in named]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"named_parameters has duplicate names {sorted(dupes)[:5]}; pass model.named_parameters()")
    known = {id(p) for _, p in named}
    unnamed = [i for i, p in enumerate(params) if id(p) not in known]
    if unnamed:
        raise ValueError(f"{len(unnamed)} optimizer parameters are missing from named_parameters; "
                         "pass named_parameters=model.named_parameters() for the same model the optimizer holds")
    in_opt = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in in_opt]


def _check_same_everywhere(comm, config, layers):
    """Ranks must agree on config and layer list before the first collective, or they would hang."""
    mine = json.dumps({"compression": config.model_dump(mode="json"),
                       "layers": [(l.name, list(l.shape)) for l in layers]}, sort_keys=True)
    everyone = comm.allgather_object(mine, name="rsync.config_check")
    if any(other != mine for other in everyone):
        bad = [r for r, other in enumerate(everyone) if other != everyone[0]]
        raise ValueError(f"ranks {bad} have a different compression config or model than rank 0; "
                         "every rank must build the same model and pass the same compression settings")


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         communicator=None):
    """Wrap ``optimizer`` so gradients are compressed and averaged across workers.

    compression: a dict like the YAML ``compression:`` section, e.g.
        ``{"method": "topk", "density": 0.01}``, a config object, or a Compressor.
    backward_passes_per_step: gradients of that many backward passes accumulate
        (summed, as PyTorch does) before they are exchanged.
    """
    from ..comm import HorovodCommunicator
    from ..compressors import parse_compression
    from ..compressors.config import DECENTRALIZED
    if not hasattr(compression, "compress"):    # not a Compressor object: a dict or a config
        config = parse_compression(compression if compression is not None else {"method": "none"})
        if config.method in DECENTRALIZED:
            from .decentralized import _DecentralizedOptimizer
            if backward_passes_per_step != 1:
                raise ValueError("backward_passes_per_step must be 1 for decentralized methods")
            cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DecentralizedOptimizer.__dict__))
            return cls(optimizer.param_groups, named_parameters, config)
    compressor, config = build_compressor(compression)
    comm = communicator or HorovodCommunicator()
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compressor, config, backward_passes_per_step, comm)
