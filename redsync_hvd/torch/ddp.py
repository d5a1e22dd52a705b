"""The same compressors under PyTorch DDP and ``torchrun``: a DDP communication hook.

    model = DistributedDataParallel(net)          # Gloo on CPU, NCCL on CUDA
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = redsync_hvd.torch.ddp.register(model, compression={"method": "redsync", "density": 0.01},
                                           optimizer=opt)
    ... train as usual; state.communication_stats(); state.state_dict()

A step (DDP calls the hook once per bucket, in bucket order, the same order on every rank):

  1. Each bucket's hook hands every parameter's gradient (a view of DDP's bucket buffer)
     to the :class:`~redsync_hvd.exchange.GradientExchange` under the parameter's name:
     compensate with the residual, compress, start the collective. The hook returns a
     future that is not set yet, so communication overlaps the rest of the backward pass.
  2. The last bucket's hook (``bucket.is_last()``) finishes the step: the exchange waits,
     decodes, agrees across ranks that every gradient was finite and commits the residuals.
     Each averaged gradient is written into its bucket view and every future is set.
     If the step fails (a NaN on any rank), every future carries the error, ``backward()``
     raises it on every rank and the residuals stay as they were.
  3. DDP copies the buckets into ``.grad``; the optimizer steps as usual.

Residuals, velocities and per-layer decisions are kept per parameter name, not per bucket:
DDP rebuilds its buckets after the first iteration (in the order gradients became ready),
which would scramble state keyed by bucket (torch's PowerSGD hook needs
``start_powerSGD_iter >= 2`` for that reason).

``method: none`` takes a fast path: DDP's own reduction, one asynchronous allreduce of
the whole bucket buffer divided by N first (as DDP divides, so the result is bit for bit
DDP's), with its bytes counted and no per-layer work. Its finite check is off unless
``check_finite: true`` is set explicitly: the check exists to keep NaN out of state that
outlives a step (residuals, velocities) and to keep ranks in agreement, and dense DDP has
neither problem (every rank gets the same average), while the check costs one pass over the
gradients per step (scripts/bench_ddp_hook.py times it).
Set explicitly, it sums every averaged bucket once the last one is reduced and reads the
total once: a NaN or Inf on any rank is in every rank's average, so every rank raises
without a collective of its own.
The same path serves a compressing method whose exchange sends every layer dense
(``policy.mode: cost_model`` where compression does not pay, decided at start or by the
review while training): from the step after that is known, and once no residual is left
to send, the hooks run DDP's reduction and the exchange is skipped.

Methods that fit a hook: everything that compresses one step's gradients (none, fp16,
topk, randomk, redsync, iwp and the allreduce/allgather baselines). Refused, with the
Horovod path named: SBC, the decentralized methods (dcd, ecd, dpsgd, naive: no allreduce at
all) and ``sparse_update`` (it updates the weights inside the optimizer step).

Local steps (``local_steps`` above 1, for redsync and topk) need ``optimizer``: the hook then
sends nothing, each worker's own gradient stays in its buckets, and :func:`register` makes
``optimizer.step`` the round's local step (``delayed.LocalRounds``, the same object the Horovod
optimizer drives): every ``local_steps`` steps the model deltas go through the exchange and every
worker restarts from the common weights plus the average, as PyTorch's post-local SGD does
with a wrapper optimizer. ``state.sync_next_step()`` ends the round at the next step.

Momentum correction (DGC, Lin et al., ICLR 2018) is supported when ``optimizer`` is given:
as :class:`~redsync_hvd.torch.optimizer.DistributedOptimizer` does, the optimizer's momentum
(and weight decay) move into the residual memory, the hook adds ``weight_decay * w`` to
each gradient before it enters the velocity, and the optimizer then takes plain SGD steps
on what arrives. Build the optimizer before calling :func:`register`: its param groups are
edited (momentum, nesterov and weight_decay set to 0). Without ``optimizer`` a config that
asks for momentum correction is refused with that fix.

Mixed precision: bf16/fp16 gradients (autocast, or parameters of that dtype) enter the
exchange as fp32 and the averages are written back into the buckets in their dtype;
residuals stay fp32. With fp16 and ``torch.amp.GradScaler``, call
``state.set_grad_scaler(scaler)`` once, then ``scaler.scale(loss).backward();
scaler.step(opt); scaler.update()`` as usual (docs/ddp.md).
"""
from __future__ import annotations

import math
import types
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..comm.torch_dist import TorchDistCommunicator
from ..compressors.base import Compressor
from ..core.stats import CommStats
from ..engine import AdamSpec, build_exchange, check_same_everywhere, parse, refuse
from ..exchange import NonFiniteGradientError
from .delayed import LOCAL_STEPS_SCALER, LocalRounds, local_auto_note
from .params import layers_of, take_momentum
from .update_units import UpdateUnitsStep, local_adam, take_moments

NO_OPTIMIZER_NOTE = ("compression.local_steps: 1 (auto): register() was given no optimizer, which local steps would "
                     "step: pass optimizer=opt for 8 local steps (docs/redsync.md, 'Local steps')")


class BucketViews(NamedTuple):
    """A DDP bucket as the hook hands it on: its parameters' names, the parameters, their gradients
    (views of the buffer), the fp32 ones flat (where the exchange decodes in place) and the buffer."""
    names: list
    params: list
    grads: list
    into: dict
    buffer: torch.Tensor


class DDPCompressionState:
    """What :func:`register` returns: the step's pending buckets, the exchange, and the accessors
    the Horovod optimizer offers (``communication_stats``, ``layer_decisions``,
    ``set_steps_per_epoch``, ``state_dict``/``load_state_dict``)."""

    def __init__(self, config, comm, named: list, exchange=None, decay=None):
        self.config = config
        self.comm = comm
        self.exchange = exchange
        self.stats = exchange.stats if exchange is not None else CommStats()
        self._name = {id(p): n for n, p in named}
        self._decay = decay or {}
        self.update_units = None     # feedback_units: update: the optimizer's hooks (update_units.py)
        self.rounds = None           # local steps: the round the wrapped optimizer step is in (delayed.py)
        self._pending: list = []     # (views, future) of this step's buckets
        self._views: dict = {}       # (bucket index, buffer address) -> that buffer's BucketViews
        self._bucket_bytes: dict = {}    # fast path: (bucket index, buffer address) -> bytes
        self._reduced: list = []         # fast path: (work, buffer, future) of this step's buckets
        # fast path: check only when asked for by name (see the module docstring)
        self._check_dense = config.finite_check
        self._fast, self._layout = False, None   # the exchange's layers all dense: DDP's own reduction

    # -- the step, from the hooks -----------------------------------------------
    def submit_bucket(self, bucket) -> torch.futures.Future:
        """Steps 1 and 2 of the module docstring, for one bucket; the fast path where every layer
        travels dense (decided at a step's first bucket, from what every rank agreed)."""
        if not self._pending and not self._reduced:
            self._fast = self._all_dense()
        if self._fast:
            return self.reduce_bucket(bucket)
        views = self._bucket_views(bucket)
        try:
            for name, p, g in zip(views.names, views.params, views.grads):
                self.exchange.submit(name, self._with_decay(name, p, g))
        except BaseException:
            self.exchange.abort()   # the next backward starts a clean step
            self._pending = []
            raise
        buffer = views.buffer
        fut = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        self._pending.append((views, fut))
        if bucket.is_last():
            self._finish_step()
        return fut

    def _bucket_views(self, bucket) -> BucketViews:
        """``bucket``'s parameters and names, and its gradients as views of its buffer, made once per
        buffer: DDP keeps a bucket's buffer from step to step (it rebuilds its buckets once, after the
        first iteration, into new buffers), and making the views costs small ops per parameter. A
        rebuilt bucket's old views go, so they keep no old buffer alive."""
        buffer = bucket.buffer()
        key = (bucket.index(), buffer.data_ptr(), buffer.numel(), buffer.dtype)
        views = self._views.get(key)
        if views is None:
            params, grads = bucket.parameters(), bucket.gradients()
            into = {n: g.view(-1) for n, g in zip(self.names_of(params), grads)
                    if g.dtype == torch.float32 and g.is_contiguous()}
            self._views = {k: v for k, v in self._views.items() if k[0] != key[0]}
            views = self._views[key] = BucketViews(self.names_of(params), params, grads, into, buffer)
        return views

    def keep_bucket(self, bucket) -> torch.futures.Future:
        """Local steps: each worker keeps its own gradient, unreduced; the round's exchange of model
        deltas follows its optimizer steps (``delayed.LocalRounds``)."""
        buffer = bucket.buffer()
        fut = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        fut.set_result(buffer)
        return fut

    def sync_next_step(self) -> None:
        """Local steps: the next optimizer step ends its round with an exchange, so every worker holds
        the same weights after it (the runner calls it before a run's last step). Every step
        already exchanges: nothing to do."""
        if self.rounds is not None:
            self.rounds.sync_next = True

    def _all_dense(self) -> bool:
        """Whether the exchange sends every layer dense and holds no residual still to send (the
        cost model decided so at start, or its review since): then the exchange would only add its
        per-layer work to DDP's allreduce. Looked at again only when the exchange rebuilt its buckets."""
        ex = self.exchange
        if ex.pending:
            return False
        layout = getattr(ex, "rebuilt", 0)
        if layout != self._layout:
            self._layout, self._dense_only = layout, not any(l.compressed for l in ex.layers.values())
        return self._dense_only

    def count_bucket(self, bucket) -> None:
        """The fast path's accounting: what DDP's own allreduce of this bucket hands over. A
        bucket's layers and sizes only change when DDP rebuilds its buckets (new buffers), so
        they are worked out once per buffer, and a step costs two counter updates."""
        buffer = bucket.buffer()
        key = (bucket.index(), buffer.data_ptr())
        wire = self._bucket_bytes.get(key)
        if wire is None:
            for name, g in zip(self.names_of(bucket.parameters()), bucket.gradients()):
                self.stats.layer(name, "dense", None, None, g.numel() * g.element_size(), 4 * g.numel())
            wire = self._bucket_bytes[key] = ({"values": buffer.numel() * buffer.element_size()}, 4 * buffer.numel())
        self.stats.add_bytes(wire[0], "dense")
        self.stats.add("dense_bytes", wire[1])
        if bucket.is_last():
            self.stats.end_step()

    def reduce_bucket(self, bucket) -> torch.futures.Future:
        """The fast path: DDP's reduction of one bucket (divide by N, one asynchronous allreduce),
        counted. Its future is set by the last bucket's hook, which waits for every bucket's
        allreduce (they ran during backward; DDP waits for them right after anyway), checks
        them all at once and sets every future: no callback per bucket, no second thread."""
        self.count_bucket(bucket)
        buffer = bucket.buffer().div_(self.comm.size)
        work = dist.all_reduce(buffer, group=self.comm.group, async_op=True)
        fut = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        self._reduced.append((work, buffer, fut))
        if bucket.is_last():
            reduced, self._reduced = self._reduced, []
            for work, _, _ in reduced:
                work.wait()
            error = self._nonfinite([b for _, b, _ in reduced]) if self._check_dense else None
            for _, buffer, fut in reduced:
                if error is not None:
                    fut.set_exception(error)
                else:
                    fut.set_result(buffer)
        return fut

    def _nonfinite(self, averaged: list):
        """A NaN or Inf on any rank is in every rank's average, so every rank finds it, with no
        collective of its own: one summing pass per bucket, no mask tensor, one host read."""
        total = torch.stack([b.sum(dtype=torch.float32) for b in averaged]).sum()
        if math.isfinite(float(total)):
            return None
        return NonFiniteGradientError(
            f"non-finite gradient (NaN/Inf) in DDP's averaged gradients at step {self.stats.steps}: some "
            "rank's gradient held NaN or Inf. Lower the learning rate, clip gradients or check the input "
            "data; compression.check_finite=false disables this check")

    def names_of(self, params) -> list:
        try:
            return [self._name[id(p)] for p in params]
        except KeyError:
            raise RuntimeError("a DDP bucket holds a parameter that register() did not see: register the "
                               "hook on the same DDP model, after every parameter exists") from None

    def _with_decay(self, name: str, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        wd = self._decay.get(name, 0.0)
        # momentum correction: weight decay joins the gradient before it enters the velocity
        return grad.add(param.detach(), alpha=wd) if wd else grad

    def _finish_step(self) -> None:
        """Finish the exchange, write each average into its bucket view, set every future."""
        pending, self._pending = self._pending, []
        into = pending[0][0].into if len(pending) == 1 else {n: t for v, _ in pending for n, t in v.into.items()}
        try:
            averaged = self.exchange.finish(into=into).averages
        except BaseException as exc:   # the exchange rolled its memory back; every rank raises
            for _, fut in pending:
                fut.set_exception(exc)
            return
        copies = [(grad, averaged[name]) for v, _ in pending for name, grad in zip(v.names, v.grads)
                  if averaged[name].data_ptr() != grad.data_ptr()]
        if copies:   # one call for every layer not decoded in place (bf16 buckets, planned ones)
            torch._foreach_copy_([g for g, _ in copies], [a.view(g.shape) for g, a in copies])
        for v, fut in pending:
            fut.set_result(v.buffer)

    def set_grad_scaler(self, scaler) -> None:
        """fp16 training with ``torch.amp.GradScaler``: buckets hold scaled gradients; residuals
        keep unscaled values and a step that overflows on any rank leaves them as they were and
        sets inf gradients, so ``scaler.step`` skips it. The fast path keeps no state: the
        overflow reaches every rank's average and the scaler finds it there, so its own finite
        check (which would raise) is turned off."""
        if self.rounds is not None:
            raise ValueError(LOCAL_STEPS_SCALER.format(steps=self.rounds.steps))
        if self.exchange is not None:
            self.exchange.use_grad_scaler(scaler)
        elif scaler.is_enabled():
            self._check_dense = False

    # -- accessors -----------------------------------------------------------
    def communication_stats(self) -> dict:
        """Cumulative per-worker figures since start, as the Horovod optimizer reports them."""
        if self.exchange is not None:
            return self.exchange.communication_stats()
        out = self.stats.summary()
        out["last_step"] = dict(getattr(self.stats, "last", {}))
        out["layers"] = dict(self.stats.layers)
        return out

    def layer_decisions(self) -> list:
        """How each layer travels (compressed or dense, density, and why)."""
        return self.exchange.layer_decisions() if self.exchange is not None else []

    def set_steps_per_epoch(self, steps: int) -> None:
        """Needed by epoch-based schedules such as ``warmup.epochs``."""
        if self.exchange is not None:
            self.exchange.set_steps_per_epoch(steps)

    def state_dict(self) -> dict:
        """This rank's compression state (residuals are per worker: save one per rank)."""
        inner = self.exchange.state_dict() if self.exchange is not None else {"stats": self.stats.state_dict()}
        if self.rounds is not None:
            inner["delay"] = self.rounds.state_dict()
        return {"method": self.config.method, "world_size": self.comm.size, "exchange": inner}

    def load_state_dict(self, state: dict) -> None:
        if state.get("method") != self.config.method or state.get("world_size") != self.comm.size:
            raise ValueError(f"this compression state was saved with method {state.get('method')!r} on "
                             f"{state.get('world_size')} workers, but the hook runs {self.config.method!r} on "
                             f"{self.comm.size}: resume with the same compression config and world size")
        if self.exchange is not None:
            inner = dict(state["exchange"])
            delay = inner.pop("delay", None)
            if (delay is None) != (self.rounds is None):
                raise ValueError("this compression state was saved " + ("with" if delay else "without") + " local "
                                 "steps and the hook runs " + ("without" if delay else "with") + " them: resume "
                                 "with the compression config it was saved with")
            self.exchange.load_state_dict(inner)
            if delay is not None:
                self.rounds.load_state_dict(delay)
        else:
            self.stats.load_state_dict(state["exchange"]["stats"])


# the hooks take no annotations: DDP compares them literally with its own
def _exchange_hook(state, bucket):
    return state.submit_bucket(bucket)


def _local_hook(state, bucket):
    return state.keep_bucket(bucket)


def _allreduce_hook(state, bucket):
    return state.reduce_bucket(bucket)


def register(ddp_model, compression=None, process_group=None, optimizer=None,
             total_steps=None) -> DDPCompressionState:
    """Register the compression hook on ``ddp_model``; return its state (stats, checkpoints).

    1. parse the config and refuse what a gradient hook cannot run, naming the Horovod path;
    2. list the parameters DDP reduces;
    3. ``none``: check that every rank has the same config and model, and register the fast
       allreduce hook; otherwise build the exchange over a torch.distributed communicator with
       the engine (agreement, memory with momentum taken out of ``optimizer`` for momentum
       correction, policy) and register the exchange hook.

    compression: a dict like the YAML ``compression:`` section, a config object, or a Compressor.
    process_group: the group to reduce over (default: the DDP model's own group).
    optimizer: the optimizer that will step ``ddp_model``; needed for momentum correction.
    total_steps: the run's length, where known (``DistributedOptimizer``'s: RedSync's
    ``local_steps: auto`` under Adam runs every step in gradient units in a long enough run).
    """
    config = parse(compression)
    refuse(config, "torch", "ddp")
    comm = TorchDistCommunicator(process_group if process_group is not None
                                 else getattr(ddp_model, "process_group", None))
    named = _reduced_parameters(ddp_model)
    layers = layers_of(named)
    auto = getattr(config, "local_steps", None) == "auto" and not isinstance(compression, Compressor)
    if auto:
        config = compression = _settle(config, optimizer, named, total_steps)
    if config.dense_fast_path and not isinstance(compression, Compressor):
        check_same_everywhere(comm, config, layers)
        state = DDPCompressionState(config, comm, named)
        ddp_model.register_comm_hook(state, _allreduce_hook)
        return state
    take = _momentum_taker(optimizer, named)
    built = build_exchange(compression, layers, comm, engine="ddp", take_momentum=take,
                           take_moments=take and (lambda: take_moments(optimizer, {p: n for n, p in named})))
    decay = built.momentum.weight_decay if built.momentum else {}
    state = DDPCompressionState(built.config, comm, named, built.exchange, decay)
    if auto:
        built.exchange.policy.notes.append(local_auto_note(config, total_steps) if optimizer is not None
                                           else NO_OPTIMIZER_NOTE)
    if built.config.delayed:
        _run_local_steps(state, optimizer, named)
        ddp_model.register_comm_hook(state, _local_hook)
        return state
    if built.moments:   # compressed layers arrive as Adam steps: the optimizer's hooks apply them
        state.update_units = UpdateUnitsStep(optimizer, {p: n for n, p in named}, built.exchange.memory)
        state.update_units.hook(optimizer)
    ddp_model.register_comm_hook(state, _exchange_hook)
    return state


def _settle(config, optimizer, named: list, total_steps: int | None = None):
    """``local_steps: auto`` under the hook (``AllgatherConfig.settle``): local steps of ``optimizer``,
    int8 values under SGD and one shared variance under an Adam this adapter reproduces; every
    step where no optimizer was given, since local steps step it."""
    if optimizer is None:
        return config.model_copy(update={"local_steps": 1})
    adam = isinstance(take_moments(optimizer, {p: n for n, p in named}), AdamSpec)
    return config.settle("torch", "ddp", sgd=isinstance(optimizer, torch.optim.SGD), adam=adam, steps=total_steps)


def _run_local_steps(state, optimizer, named: list) -> None:
    """``local_steps`` above 1: the hook sends nothing and ``optimizer.step`` becomes a local step
    of the round (``delayed.LocalRounds``: every ``local_steps`` steps the model deltas go through
    the exchange), as PyTorch's post-local SGD wraps its optimizer. The method replaces ``step``
    on this optimizer object, so the training loop stays as it was."""
    config = state.config
    if optimizer is None:
        raise ValueError(f"compression.local_steps: {config.local_steps}: each worker takes steps of its own "
                         "optimizer and the model deltas are exchanged after them: pass "
                         "register(ddp_model, compression, optimizer=opt), or set local_steps: 1")
    _check_holds(optimizer, named, "local steps exchange what it steps")
    inner, share = local_adam(optimizer, {p: n for n, p in named}, config, state.comm)
    state.rounds = LocalRounds(state.exchange, dict(named), config, share)
    own = optimizer.step

    def step(opt, closure=None):
        return state.rounds.step(closure, inner or own)
    optimizer.step = types.MethodType(step, optimizer)   # bound, as LR schedulers expect to wrap it


def _reduced_parameters(ddp_model) -> list:
    """(name, parameter) for every parameter DDP reduces, in registration order."""
    module = getattr(ddp_model, "module", None)
    if module is None or not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError(f"register() needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first, DistributedDataParallel(model)")
    ignored = set(getattr(ddp_model, "parameters_to_ignore", ()) or ())
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in ignored]


def _momentum_taker(optimizer, named: list):
    """With momentum correction the optimizer's momentum and weight decay move into the residual
    memory (its param groups are edited); a DDP hook sees gradients only, so it needs the optimizer."""
    if optimizer is None:
        return None
    names = {p: n for n, p in named}

    def take():
        _check_holds(optimizer, named, "momentum correction moves its momentum per parameter")
        return take_momentum(optimizer.param_groups, names)
    return take


def _check_holds(optimizer, named: list, why: str) -> None:
    """Refuse an optimizer that does not step every parameter DDP reduces."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for n, p in named if id(p) not in held]
    if missing:
        raise ValueError(f"optimizer does not hold parameters {missing[:5]} of the DDP model: pass the optimizer "
                         f"built on ddp_model.parameters() ({why})")
