"""Drop-in replacement for ``horovod.torch.DistributedOptimizer`` with stateful compression.

Like Horovod, it subclasses the user's optimizer class on the fly, so LR schedulers,
``isinstance`` checks and ``param_groups`` keep working. Gradient hooks
(``register_post_accumulate_grad_hook``) hand each parameter's gradient to the
:class:`~redsync_hvd.exchange.GradientExchange` as soon as backward produces it
(after ``backward_passes_per_step`` passes), so communication overlaps backward.
``step()`` waits for the exchange, writes the averaged gradients into ``.grad``
and runs the wrapped optimizer's update.

horovod.torch's keywords (``op``, ``gradient_predivide_factor``, ``groups``, ``sparse_as_dense``,
``process_set``) and methods (``synchronize``, ``skip_synchronize``,
``set_backward_passes_per_step``) behave as there; docs/horovod_api.md says how each maps
onto the exchange. Sparse gradients travel beside it (``sparse.py``).
"""
from __future__ import annotations

import os
import warnings
import weakref
from contextlib import contextmanager

import torch

from ..comm import HorovodCommunicator
from ..compressors.base import Compressor
from ..engine import AdamSpec, build_exchange, parse
from .decentralized import DecentralizedOptimizer
from .delayed import LOCAL_STEPS_SCALER, LocalRounds, local_auto_note
from .options import (
    HorovodOptions,
    OutsideProcessSet,
    check_passes,
    refuse_for_decentralized,
    resolve,
    with_group_hint,
)
from .params import check_plain_sgd, layers_of, plain_sgd_problems, resolve_names, take_momentum
from .sparse import SparseRows, makes_sparse_grads
from .update_units import UpdateUnitsStep, local_adam, take_moments

SPARSE_AUTO_NOTE = ("compression.sparse_update: true (auto under policy.mode: cost_model): the optimizer is plain "
                    "SGD, so step() applies each compressed layer's average straight to its weights; their .grad "
                    "is None after step() (synchronize() first gives dense averages)")
STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                   "optimizer.synchronize(): step() uses the gradients synchronize() wrote (horovod.torch would "
                   "exchange them again); wrap step() in `with optimizer.skip_synchronize():`")


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, compression, backward_passes_per_step, comm,
                 options: HorovodOptions, total_steps: int | None = None):
        super(self.__class__, self).__init__(params)
        check_passes(backward_passes_per_step)
        self.backward_passes_per_step = backward_passes_per_step
        named = resolve_names(named_parameters, self.param_groups)
        self._params = dict(named)
        self._names = {p: n for n, p in named}
        self._parameter_names = self._names   # horovod.torch's name for it
        spec = parse(compression)
        auto = getattr(spec, "local_steps", None) == "auto" and not isinstance(compression, Compressor)
        if auto:   # local_steps: auto is settled here, the one place local steps run
            spec = compression = self._settle(spec, total_steps)
        self._horovod_options(options, comm, spec)
        sparse = {n for n, p in named if makes_sparse_grads(self, p)}
        rows = {n: p for n, p in named if n in sparse and not (options.sparse_as_dense or self._delayed)}
        exchanged = [(n, p) for n, p in named if n not in rows]
        if rows and spec.corrects_momentum:
            raise ValueError("compression.dgc.momentum_correction takes the optimizer's momentum into the exchange, "
                             f"which the sparse gradients of {sorted(rows)[:3]} travel beside: pass "
                             "sparse_as_dense=True, or set dgc: {momentum_correction: false}")
        built = build_exchange(compression, layers_of(exchanged), comm,
                               take_momentum=lambda: take_momentum(self.param_groups, self._names),
                               take_moments=lambda: take_moments(self, self._names))
        self._exchange, self.compression_config = built.exchange, built.config
        if auto:
            self._exchange.policy.notes.append(local_auto_note(spec, total_steps))
        # feedback_units: update: compressed layers arrive as Adam steps, applied here (update_units.py)
        self._units = UpdateUnitsStep(self, self._names, built.exchange.memory) if built.moments else None
        if built.config.follows_own_lr:
            self._exchange.lr_of = lambda: self.param_groups[0]["lr"]
        self._weight_decay = built.momentum.weight_decay if built.momentum else {}
        config = built.config
        self._sparse_update = config.updates_in_step
        if self._sparse_update:
            check_plain_sgd(self)
            if options.op != "average" or options.predivide != 1.0:
                raise ValueError("compression.sparse_update applies the average straight to the weights, which "
                                 "op=hvd.Sum and gradient_predivide_factor would have to scale: set sparse_update: "
                                 "false, or leave op and gradient_predivide_factor at their defaults")
        self._sparse_auto = self._choose_sparse_update(config, options)
        self._rows = SparseRows(comm, rows, options.op == "average", self._exchange.stats) if rows else None
        self._arrived_sparse: set = set()   # this step's layers whose gradient came sparse and went dense
        self._warned_sparse: set = set()
        self._passes = {n: 0 for n, _ in named}
        self._synchronized = False
        self._skip_sync = False
        # communication delay (SBC): local steps, then the model delta goes through the exchange
        self._local_steps = config.local_steps if config.delayed else None
        self._rounds = None
        if self._local_steps:   # adam_variance: of_average / shared replace the wrapped Adam's step
            self._inner_step, share = local_adam(self, self._names, config, comm)
            self._rounds = LocalRounds(self._exchange, self._params, config, share)
        self._hooks = [] if self._local_steps else \
            [p.register_post_accumulate_grad_hook(self._make_hook(n)) for n, p in named]
        weakref.finalize(self, _remove_hooks, self._hooks)   # a model that outlives us trains on unhooked
        # sparse gradients must stay sparse for their optimizer: no dense buffer for them to land in
        self._landing_named = [] if self._local_steps else [(n, p) for n, p in exchanged if n not in sparse]
        self._landing, self._layout = self._grad_views(self._landing_named), 0
        self._attach()

    def _settle(self, spec, total_steps: int | None):
        """``local_steps: auto`` made concrete for this optimizer: int8 values under SGD, one shared
        Adam variance under an Adam this adapter reproduces, or in a long enough run
        (``total_steps``) an exchange every step in gradient units (``AllgatherConfig.settle``)."""
        return spec.settle("torch", "horovod", elastic=os.environ.get("HOROVOD_ELASTIC") == "1",
                           sgd=isinstance(self, torch.optim.SGD),
                           adam=isinstance(take_moments(self, self._names), AdamSpec), steps=total_steps)

    def _choose_sparse_update(self, config, options: HorovodOptions) -> bool:
        """``sparse_update: auto`` under the cost model: on where this optimizer is plain SGD (as it is
        once momentum correction holds momentum and weight decay) and the average is applied as
        it is; layers.log says which, and why not."""
        if not getattr(config, "may_update_in_step", False) or self._delayed:
            return False
        problems = plain_sgd_problems(self)
        if options.op != "average" or options.predivide != 1.0:
            problems.append("op=hvd.Sum or gradient_predivide_factor scales the average")
        notes = self._exchange.policy.notes
        if problems:
            notes.append(f"compression.sparse_update: false (auto): {'; '.join(problems)}")
            return False
        self._sparse_update = True
        notes.append(SPARSE_AUTO_NOTE)
        return True

    def _horovod_options(self, options: HorovodOptions, comm, spec) -> None:
        """horovod.torch's attributes, and what the exchange does with them: a gradient
        prescale and an average postscale (op=Sum, gradient_predivide_factor)."""
        self.op, self.gradient_predivide_factor = options.op, options.predivide
        self.sparse_as_dense, self.process_set = options.sparse_as_dense, options.process_set
        self._prescale, self._postscale = options.prescale, options.postscale(comm.size)
        self._delayed = bool(getattr(spec, "delayed", False))
        if self._delayed and (self._prescale or self._postscale):
            raise ValueError("local steps (sbc, or local_steps > 1) average model deltas, not gradients: "
                             "op=hvd.Sum and gradient_predivide_factor do not apply; leave them at their defaults")

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
        if getattr(self._exchange, "rebuilt", 0) != self._layout:   # the cost model's review rebuilt the buckets
            self._layout = self._exchange.rebuilt
            self._landing = self._grad_views(self._landing_named)
        flats = {v.untyped_storage().data_ptr(): v._base for v in self._landing.values() if v._base is not None}
        for flat in flats.values():
            flat.zero_()   # a fill per bucket, not per layer
        self._attach()

    def _make_hook(self, name):
        # a weak reference: the hook lives in autograd's C++ side of the parameter, which the garbage
        # collector cannot see through, so a strong one kept every dropped optimizer (and through it
        # its parameters, moments and exchange buffers) alive for the life of the process
        ref = weakref.ref(self)

        def hook(p):
            self = ref()
            if self is None:   # the optimizer is gone; its parameter outlived it
                return
            self._passes[name] += 1
            if self._passes[name] == self.backward_passes_per_step:
                if self._rows is not None and name in self._rows.params:
                    self._rows.start(name, p.grad)
                else:
                    self._exchange.submit(name, self._grad(name, p))
        return hook

    def _grad(self, name, p):
        """The gradient the exchange takes: zeros where there is none (another rank may have one),
        dense where it came sparse (sparse_as_dense), with DGC's weight decay and the prescale."""
        g, own = p.grad, True   # own: free to change in place (ours, or a bucket's buffer)
        if g is None:
            g = torch.zeros_like(p)
        elif g.is_sparse:
            g = self._densify(name, g)
        else:
            view = self._landing.get(p)
            own = view is not None and g.data_ptr() == view.data_ptr()
        wd = self._weight_decay.get(name, 0.0)
        if wd:
            # with momentum correction, weight decay joins the gradient before it enters the velocity;
            # in place in a bucket's buffer (what it holds is replaced by the average anyway)
            g, own = (g.add_(p.detach(), alpha=wd) if own else g.add(p.detach(), alpha=wd)), True
        if self._prescale is not None:   # in the gradient's dtype, as Horovod scales an fp32 buffer
            g = g.mul_(self._prescale) if own else g * self._prescale
        return g

    def _densify(self, name: str, g: torch.Tensor) -> torch.Tensor:
        """A sparse gradient entering the exchange: made dense, and sparse again after (``_write``)."""
        self._arrived_sparse.add(name)
        if not self.sparse_as_dense and name not in self._warned_sparse:
            self._warned_sparse.add(name)
            warnings.warn(f"parameter {name!r} has a sparse gradient, which DistributedOptimizer only allgathers as "
                          "rows for parameters known sparse when it is built (SparseAdam's, or with a sparse .grad "
                          "then): it is averaged dense here, as sparse_as_dense=True does", stacklevel=3)
        return g.to_dense()

    def set_backward_passes_per_step(self, passes: int) -> None:
        """As horovod.torch's: from now on gradients of ``passes`` backward passes accumulate before
        they are exchanged (the passes counted so far in this step start again)."""
        check_passes(passes)
        self.backward_passes_per_step = passes
        self._passes = dict.fromkeys(self._passes, 0)

    @property
    def exchange(self):
        """The :class:`~redsync_hvd.exchange.GradientExchange` this optimizer feeds."""
        return self._exchange

    def abort_step(self) -> None:
        """Forget a step that failed half way (a collective interrupted by a lost worker): the
        exchange rolls back, gradients already counted as passes are forgotten."""
        self._exchange.abort()
        if self._rows is not None:
            self._rows.abort()
        self._passes = dict.fromkeys(self._passes, 0)
        self._arrived_sparse = set()
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
        if self._sparse_update and self._sparse_auto:   # chosen, not asked for: the scaler must skip steps
            self._sparse_update = False
            self._exchange.policy.notes.append("compression.sparse_update: false (auto): a GradScaler skips "
                                               "overflowing steps, which an update inside step() would not")
        if self._sparse_update:
            raise ValueError("compression.sparse_update updates the weights inside step(), before a GradScaler "
                             "could skip an overflowing step: set sparse_update: false to train with fp16")
        if self._local_steps:
            raise ValueError(LOCAL_STEPS_SCALER.format(steps=self._local_steps))
        self._exchange.use_grad_scaler(scaler)

    def synchronize(self):
        """Finish this step's exchange and write the averaged gradients into ``.grad`` (SBC:
        nothing, its exchange follows the local steps)."""
        if not self._local_steps:
            self._synchronize(apply_sparse=False)

    def _synchronize(self, apply_sparse: bool):
        """``apply_sparse`` (``sparse_update``, from ``step()``): layers that travelled sparse are
        decoded straight into their weights as p -= lr * average; their ``.grad`` becomes None
        so the wrapped SGD leaves them alone. Sparse gradients' rows are gathered first: NaN/Inf
        in them fails the step as the exchange's own would (with check_finite)."""
        ex = self._exchange
        for name in ex.missing():
            ex.submit(name, self._grad(name, self._params[name]))
        # layers compressed sparse are decoded straight into .grad (no layer-sized copy per step)
        into = {n: self._params[n].grad.view(-1) for n in ex.order if self._dense_fp32_grad(self._params[n])}
        apply = None
        if apply_sparse:
            apply = {self._names[p]: (p.detach().view(-1), group["lr"]) for group in self.param_groups
                     for p in group["params"] if p in self._names and self._names[p] in ex.layers
                     and p.dtype == torch.float32 and p.is_contiguous()}
        try:
            rows = self._rows.finish() if self._rows is not None else {}
            if ex.check_finite and SparseRows.nonfinite(rows):
                ex.veto(SparseRows.nonfinite(rows))
            result = ex.finish(into=into, apply=apply)
        except BaseException:
            ex.abort()   # (a no-op where finish already rolled back)
            raise
        finally:
            self._passes = dict.fromkeys(self._passes, 0)
            arrived, self._arrived_sparse = self._arrived_sparse, set()
        self._write(result, arrived)
        if self._rows is not None:
            self._rows.write(rows)
        self._synchronized = True

    @staticmethod
    def _dense_fp32_grad(p) -> bool:
        g = p.grad
        return g is not None and not g.is_sparse and g.dtype == torch.float32 and g.is_contiguous()

    def _write(self, result, arrived: set) -> None:
        """The exchange's averages into ``.grad``: scaled for op=Sum or a predivide factor (one fp32
        multiply: Horovod's postscale f/N after the sum, where N is a power of two), and sparse
        again where the gradient came sparse (``p.grad.zero_().add_(average.to_sparse())``, as
        horovod.torch's sparse_as_dense)."""
        for name in result.applied:
            self._params[name].grad = None
        if self._postscale is not None:
            torch._foreach_mul_(list(result.averages.values()), self._postscale)
        for name, flat in result.averages.items():
            p = self._params[name]
            if name in arrived:
                p.grad.zero_().add_(flat.view(p.shape).to(p.dtype).to_sparse())
                continue
            if p.grad is not None and flat.data_ptr() == p.grad.data_ptr():
                continue   # already there: decoded or reduced in place
            g = flat.view(p.shape).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()   # the exchange reuses its buffers next step
            else:
                p.grad.copy_(g)

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. to clip gradients) so ``step()`` does not wait again."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def sync_next_step(self) -> None:
        """Local steps (``local_steps`` above 1, SBC): the next ``step()`` ends with an exchange
        whatever the count of local steps, so every worker holds the same weights after it. The
        runner calls it before a run's last step (a run of 1,500 steps at 8 local steps would
        otherwise end 4 steps after its last exchange, each worker on its own weights). Call it
        on every rank before the same step. Every step already exchanges: nothing to do."""
        if self._rounds is not None:
            self._rounds.sync_next = True

    def step(self, closure=None):
        if self._local_steps:
            return self._rounds.step(closure, self._inner_step or super(self.__class__, self).step)
        if not self._skip_sync:
            if self._synchronized:
                warnings.warn(STEP_AFTER_SYNC, stacklevel=2)
            else:
                self._synchronize(apply_sparse=self._sparse_update)
        self._synchronized = False
        if self._units is None:
            return super(self.__class__, self).step(closure)
        self._units.apply()
        try:
            return super(self.__class__, self).step(closure)
        finally:
            self._units.restore()

    def communication_stats(self) -> dict:
        """Cumulative per-worker figures since start; see :class:`~redsync_hvd.core.stats.CommStats`."""
        return self._exchange.communication_stats()

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        state["redsync"] = self._exchange.state_dict()
        if self._local_steps:
            state["redsync"]["delay"] = self._rounds.state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("redsync", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if extra is not None:
            delay = extra.pop("delay", None)
            self._exchange.load_state_dict(extra)
            if delay is not None:
                self._rounds.load_state_dict(delay)


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                         op=None, gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=None, communicator=None, total_steps=None):
    """Wrap ``optimizer`` so gradients are compressed and averaged across workers.

    compression: a dict like the YAML ``compression:`` section, e.g.
        ``{"method": "topk", "density": 0.01}``, a config object, or a Compressor.
        Decentralized methods (dcd, ecd, dpsgd, naive) return a :class:`DecentralizedOptimizer`.
    backward_passes_per_step: gradients of that many backward passes accumulate
        (summed, as PyTorch does) before they are exchanged.
    op, gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set: as in
        ``horovod.torch.DistributedOptimizer`` (hvd.Average or hvd.Sum; Adasum is refused), in
        the same positions; docs/horovod_api.md says what each does here.
    communicator: the transport (default Horovod's, over ``process_set``), for tests and benchmarks.
    total_steps: the run's length in optimizer steps, where known (as ``OneCycleLR`` takes it):
        RedSync's ``local_steps: auto`` under Adam runs every step in gradient units when the run
        sends every layer often enough (``AllgatherConfig.settle``, rule 7); without it, local steps.
    """
    options = resolve(op, gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
    config = parse(compression)
    if config.strategy == "decentralized":
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step must be 1 for decentralized methods")
        refuse_for_decentralized(options, config.method)
        return DecentralizedOptimizer(optimizer, named_parameters, config)
    if options.process_set is not None and communicator is not None:
        raise ValueError("pass process_set or communicator, not both: a communicator brings its own ranks")
    name = optimizer.__class__.__name__
    if options.process_set is not None and not options.process_set.included():
        cls = type(name, (optimizer.__class__,), dict(OutsideProcessSet.__dict__))
        return cls(optimizer.param_groups, backward_passes_per_step)
    comm = communicator or HorovodCommunicator(process_set=options.process_set)
    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    # the parsed config, so the build does not parse it again (a Compressor object as it is)
    given = compression if isinstance(compression, Compressor) else config
    given = with_group_hint(given, options.groups, trainable)
    cls = type(name, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, given, backward_passes_per_step, comm, options, total_steps)


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()
