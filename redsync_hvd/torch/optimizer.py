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

from contextlib import contextmanager

import torch

from ..comm import HorovodCommunicator
from ..compressors.base import Compressor
from ..engine import build_exchange, parse
from .decentralized import DecentralizedOptimizer
from .params import check_plain_sgd, layers_of, resolve_names, take_momentum


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, comm):
        super(self.__class__, self).__init__(params)
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        self.backward_passes_per_step = backward_passes_per_step
        named = resolve_names(named_parameters, self.param_groups)
        self._params = dict(named)
        self._names = {p: n for n, p in named}
        built = build_exchange(compression, layers_of(named), comm,
                               take_momentum=lambda: take_momentum(self.param_groups, self._names))
        self._exchange, self.compression_config = built.exchange, built.config
        if built.config.follows_own_lr:
            self._exchange.lr_of = lambda: self.param_groups[0]["lr"]
        self._weight_decay = built.momentum.weight_decay if built.momentum else {}
        config = built.config
        self._sparse_update = config.updates_in_step
        if self._sparse_update:
            check_plain_sgd(self)
        self._passes = {n: 0 for n, _ in named}
        self._synchronized = False
        self._skip_sync = False
        # communication delay (SBC): local steps, then the model delta goes through the exchange
        self._local_steps = config.local_steps if config.delayed else None
        self._snapshot, self._local = None, 0
        self._hooks = [] if self._local_steps else \
            [p.register_post_accumulate_grad_hook(self._make_hook(n)) for n, p in named]
        self._landing = {} if self._local_steps else self._grad_views(named)
        self._attach()

    def _grad_views(self, named) -> dict:
        """{param: its view of an exchange bucket's flat buffer}, for fp32 contiguous parameters:
        backward then writes each gradient where the exchange reads it (no copy per layer)."""
        params = [p for _, p in named if p.dtype == torch.float32 and p.is_contiguous()]
        if not params:
            return {}
        views = self._exchange.grad_buffers(torch.float32, params[0].device)
        return {p: views[n].view(p.shape) for n, p in named if n in views and p in set(params)}

    def _attach(self) -> None:
        """The bucket views become the parameters' ``.grad`` (zeroed with their buffers in
        ``zero_grad``); a parameter whose ``.grad`` is set elsewhere has it copied in instead."""
        for p, view in self._landing.items():
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    def zero_grad(self, set_to_none: bool = True):
        """As the wrapped optimizer's, except for gradients that live in the exchange's bucket
        buffers: those are zeroed in place and stay there (``set_to_none`` would make backward
        allocate new ones, to be copied in every step), as DDP's ``gradient_as_bucket_view`` does."""
        super(self.__class__, self).zero_grad(set_to_none)
        flats = {v.untyped_storage().data_ptr(): v._base for v in self._landing.values() if v._base is not None}
        for flat in flats.values():
            flat.zero_()   # a fill per bucket, not per layer
        self._attach()

    def _make_hook(self, name):
        def hook(p):
            self._passes[name] += 1
            if self._passes[name] == self.backward_passes_per_step:
                self._exchange.submit(name, self._grad(name, p))
        return hook

    def _grad(self, name, p):
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        wd = self._weight_decay.get(name, 0.0)
        if not wd:
            return g
        # with momentum correction, weight decay joins the gradient before it enters the velocity;
        # in place in a bucket's buffer (what it holds is replaced by the average anyway)
        view = self._landing.get(p)
        return g.add_(p.detach(), alpha=wd) if view is not None and g.data_ptr() == view.data_ptr() \
            else g.add(p.detach(), alpha=wd)

    @property
    def exchange(self):
        """The :class:`~redsync_hvd.exchange.GradientExchange` this optimizer feeds."""
        return self._exchange

    def abort_step(self) -> None:
        """Forget a step that failed half way (a collective interrupted by a lost worker): the
        exchange rolls back, gradients already counted as passes are forgotten."""
        self._exchange.abort()
        self._passes = dict.fromkeys(self._passes, 0)
        self._synchronized = False

    def set_steps_per_epoch(self, steps: int) -> None:
        """Needed by epoch-based schedules such as ``warmup.epochs``."""
        self._exchange.set_steps_per_epoch(steps)

    def layer_decisions(self) -> list:
        """How each layer travels (compressed or dense, density, and why), decided once at start."""
        return self._exchange.layer_decisions()

    def set_grad_scaler(self, scaler) -> None:
        """fp16 training with ``torch.amp.GradScaler``: the hooks see scaled gradients; residuals
        keep unscaled values, and a step whose gradients overflow on any rank leaves them as they
        were and hands the scaler inf gradients, so it skips the step. Step with

            scaler.scale(loss).backward(); opt.synchronize()
            with opt.skip_synchronize(): scaler.step(opt)
            scaler.update()
        """
        if self._sparse_update:
            raise ValueError("compression.sparse_update updates the weights inside step(), before a GradScaler "
                             "could skip an overflowing step: set sparse_update: false to train with fp16")
        if not self._local_steps:   # SBC's local steps see local gradients, which the scaler checks itself
            self._exchange.use_grad_scaler(scaler)

    def synchronize(self):
        """Finish this step's exchange and write the averaged gradients into ``.grad`` (SBC:
        nothing, its exchange follows the local steps)."""
        if not self._local_steps:
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
            result = self._exchange.finish(into=into, apply=apply)
        finally:
            self._passes = dict.fromkeys(self._passes, 0)
        for name in result.applied:
            self._params[name].grad = None
        for name, flat in result.averages.items():
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
        averaged = ex.finish().averages
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
        return self._exchange.communication_stats()

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


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         communicator=None):
    """Wrap ``optimizer`` so gradients are compressed and averaged across workers.

    compression: a dict like the YAML ``compression:`` section, e.g.
        ``{"method": "topk", "density": 0.01}``, a config object, or a Compressor.
        Decentralized methods (dcd, ecd, dpsgd, naive) return a :class:`DecentralizedOptimizer`.
    backward_passes_per_step: gradients of that many backward passes accumulate
        (summed, as PyTorch does) before they are exchanged.
    """
    config = parse(compression)
    if config.strategy == "decentralized":
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step must be 1 for decentralized methods")
        return DecentralizedOptimizer(optimizer, named_parameters, config)
    comm = communicator or HorovodCommunicator()
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    # the parsed config, so the build does not parse it again (a Compressor object as it is)
    given = compression if isinstance(compression, Compressor) else config
    return cls(optimizer.param_groups, named_parameters, given, backward_passes_per_step, comm)
