"""TensorFlow gradients through the one algorithm core (:class:`redsync_hvd.exchange.GradientExchange`).

A :class:`TFGradientExchange` is built once per (compression config, variable list). Each step:

    TF gradient --DLPack--> torch view --> GradientExchange.submit (memory, compressor,
    horovod.torch collective) ... finish() --> averaged torch tensor --DLPack--> TF tensor

Compressor, memory and policy are built by the same helpers and with the same arguments as
:func:`redsync_hvd.torch.DistributedOptimizer` (``build_compressor``, ``_build_memory``,
``_check_same_everywhere``, ``_network``, ``LayerPolicy``), so both frameworks run the very
same objects. Collectives go through ``horovod.torch``'s Horovod instance
(:class:`~redsync_hvd.comm.HorovodCommunicator`), see docs/tensorflow.md.

Eager mode calls the exchange directly. Inside ``tf.function`` the exchange is wrapped in
``tf.py_function`` (it runs Python and torch code); errors then reach the caller as
``tf.errors.OpError`` whose message carries the original one (``last_error`` keeps the
original exception object).
"""
from __future__ import annotations

import json

import tensorflow as tf
import torch

from ..comm import HorovodCommunicator
from ..compressors.base import Layer
from ..engine import MomentumSpec, build_exchange, parse, refuse
from .dlpack import to_tf, to_torch, torch_device


def build_for_tf(compression):
    """The config, after refusing (with the reason and the alternatives) what a gradient exchange
    under TensorFlow cannot run; a bad dict fails here, as in torch's constructor."""
    config = parse(compression)
    refuse(config, "tensorflow", "horovod")
    return config


def resolve_named_variables(named_variables, sources=None) -> list:
    """[(name, variable)] with unique names, for ``sources`` (default: all of named_variables).

    named_variables: None, a dict {name: variable} or an iterable of (name, variable) pairs.
    Without names, a variable is called by its TF name (``dense/kernel``); repeated TF names
    get their position appended.
    """
    if named_variables is None:
        if sources is None:
            raise ValueError("pass named_variables=[(name, variable), ...] or the variables as sources")
        raw = [_strip(getattr(v, "name", f"var{i}")) for i, v in enumerate(sources)]
        named = [(n if raw.count(n) == 1 else f"{n}.{i}", v) for i, (n, v) in enumerate(zip(raw, sources))]
    else:
        items = named_variables.items() if isinstance(named_variables, dict) else named_variables
        named = [(str(n), v) for n, v in items]
        names = [n for n, _ in named]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"named_variables has duplicate names {dupes[:5]}; pass unique names, e.g. "
                             "[(v.name, v) for v in model.trainable_variables]")
        if sources is not None:
            by_ref = {v.ref(): n for n, v in named}
            missing = [i for i, v in enumerate(sources) if _ref(v) not in by_ref]
            if missing:
                raise ValueError(f"{len(missing)} variables in sources are missing from named_variables "
                                 f"(positions {missing[:5]}); pass named_variables for the same variables you "
                                 "differentiate, e.g. model.trainable_variables")
    for n, v in named:
        if not isinstance(v, tf.Variable):
            raise TypeError(f"{n!r}: gradients are exchanged for tf.Variable sources only, got {type(v).__name__}")
    return named


def _strip(name: str) -> str:
    return name[:-2] if name.endswith(":0") else name


def _ref(v):
    try:
        return v.ref()
    except (AttributeError, TypeError):
        return None


class TFGradientExchange:
    """One GradientExchange for a fixed list of TF variables.

    momentum / nesterov: with ``momentum_correction`` (RedSync's DGC option) the velocity is
    kept in the compression memory and the optimizer must apply plain SGD; the Keras wrapper and
    the tape take them from the optimizer you pass. ``momentum_free``: that optimizer has no
    momentum (Adam): momentum correction falls back to plain error feedback, as under torch.
    """

    def __init__(self, named_variables, compression=None, communicator=None, momentum=None, nesterov=False,
                 momentum_free=False):
        config = build_for_tf(compression)
        named = list(named_variables)
        for name, var in named:     # the core's check, worded for TF
            if var.shape.num_elements() == 0:
                raise ValueError(f"parameter {name!r} has zero elements: there is nothing to exchange. "
                                 "Remove it from named_variables or create it with trainable=False")
        self.comm = communicator or HorovodCommunicator()
        self.names = [n for n, _ in named]
        self.variables = [v for _, v in named]
        self._index = {v.ref(): i for i, v in enumerate(self.variables)}
        self.layers = [Layer(n, tuple(int(d) for d in v.shape), int(v.shape.num_elements()), i, torch_device(v.device))
                       for i, (n, v) in enumerate(named)]
        built = build_exchange(compression, self.layers, self.comm, framework="tensorflow",
                               take_momentum=self._momentum(config, momentum, nesterov, momentum_free),
                               # the averaged tensors become TF tensors (DLPack, no copy) that outlive
                               # the step: fresh buffers each step
                               reuse_buffers=False)
        self.exchange, self.config = built.exchange, built.config
        self._needs_params = config.weighs_by_weights   # IWP weighs residuals by |w|
        self.last_error: BaseException | None = None

    def _momentum(self, config, momentum, nesterov, momentum_free):
        if momentum_free:
            return lambda: None   # the engine keeps plain residuals and notes why
        if config.corrects_momentum and momentum is None:
            raise ValueError(
                "compression.dgc.momentum_correction keeps the optimizer's momentum in the compression memory: "
                "pass optimizer=<your tf.keras.optimizers.SGD> (its momentum is moved into the memory and set "
                "to 0 there) or momentum=<float> with a momentum-free optimizer; or set "
                "dgc: {momentum_correction: false}")
        return lambda: MomentumSpec(dict.fromkeys(self.names, float(momentum or 0.0)), bool(nesterov))

    # -- public -----------------------------------------------------------------
    def set_steps_per_epoch(self, steps: int) -> None:
        """Needed by epoch-based schedules such as ``warmup.epochs``."""
        self.exchange.set_steps_per_epoch(steps)

    def layer_decisions(self) -> list:
        return self.exchange.layer_decisions()

    def communication_stats(self) -> dict:
        """Cumulative per-worker figures, the same dict as the torch optimizer's."""
        return self.exchange.communication_stats()

    def state_dict(self) -> dict:
        return self.exchange.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.exchange.load_state_dict(state)

    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads, variables=None) -> list:
        """Average ``grads`` (one per variable, None allowed) across workers; returns TF tensors.

        ``variables``: the variables the gradients belong to, in the same order (default: all of
        this exchange's variables). Variables of the exchange that are not in it get a zero
        gradient, as parameters without ``.grad`` do in torch.
        """
        variables = self.variables if variables is None else list(variables)
        grads = list(grads)
        if len(grads) != len(variables):
            raise ValueError(f"{len(grads)} gradients for {len(variables)} variables")
        idx = []
        for v in variables:
            i = self._index.get(_ref(v))
            if i is None:
                raise ValueError(f"variable {getattr(v, 'name', v)!r} is not one this exchange was built for; "
                                 "build one exchange per model (or pass named_variables covering it)")
            idx.append(i)
        full = [None] * len(self.variables)
        for i, g in zip(idx, grads):
            full[i] = g
        dense = [self._dense(g, v) for g, v in zip(full, self.variables)]
        if tf.executing_eagerly():
            out = self._run(dense, self._params())
        else:
            out = self._graph(dense)
        return [out[i] for i in idx]

    # -- internals --------------------------------------------------------------
    @staticmethod
    def _dense(g, v):
        if g is None:
            return tf.zeros_like(v)
        if isinstance(g, tf.IndexedSlices):
            return tf.convert_to_tensor(g)
        return g

    def _params(self):
        return [v.value() for v in self.variables] if self._needs_params else None

    def _run(self, grads, params=None) -> list:
        """Eager: DLPack in, the core's submit/finish, DLPack out."""
        ex = self.exchange
        if params is not None:
            for layer, p in zip(self.layers, params):
                layer.param = to_torch(p)
        try:
            try:
                # reverse registration order, the order backward produces gradients in torch
                for i in reversed(range(len(grads))):
                    ex.submit(self.names[i], to_torch(grads[i]))
            except BaseException:
                ex.abort()   # failed before finish(), which aborts by itself
                raise
            averaged = ex.finish().averages      # rolls the memory back itself when it raises
        except BaseException as exc:
            self.last_error = exc
            raise
        finally:
            if params is not None:
                for layer in self.layers:
                    layer.param = None
        out = []
        for name, g, layer in zip(self.names, grads, self.layers):
            flat = averaged[name]
            if g.dtype != tf.float32:
                flat = flat.to(_TORCH_DTYPES.get(g.dtype, torch.float32))
            out.append(to_tf(flat.view(layer.shape)))
        return out

    def _graph(self, grads) -> list:
        """Inside tf.function: the same eager code, run by tf.py_function."""
        n = len(grads)
        params = self._params() or []

        def eager(*tensors):
            return self._run(list(tensors[:n]), list(tensors[n:]) or None)

        out = tf.py_function(eager, inp=list(grads) + list(params), Tout=[g.dtype for g in grads],
                             name="redsync_exchange")
        for o, g in zip(out, grads):
            o.set_shape(g.shape)
        return list(out)


_TORCH_DTYPES = {tf.float16: torch.float16, tf.bfloat16: torch.bfloat16, tf.float64: torch.float64}

# (compression key, variable refs) -> exchange: a tape wrapped anew every step (the Horovod
# idiom) keeps the residuals of the previous steps
_CACHE: dict = {}


def exchange_for(sources, compression=None, named_variables=None, optimizer=None, momentum=None,
                 communicator=None) -> TFGradientExchange:
    """The exchange for these variables and this compression, built on first use."""
    flat = [v for v in tf.nest.flatten(sources)]
    for i, v in enumerate(flat):
        if not isinstance(v, tf.Variable):
            raise TypeError(f"sources[{i}] is a {type(v).__name__}: DistributedGradientTape exchanges gradients "
                            "of tf.Variable sources (e.g. model.trainable_variables)")
    if named_variables is not None:
        named_variables = list(named_variables.items() if isinstance(named_variables, dict) else named_variables)
        vars_key = tuple(_ref(v) for _, v in named_variables)
    else:
        vars_key = tuple(v.ref() for v in flat)
    key = (_compression_key(compression), vars_key, id(optimizer), id(communicator))
    ex = _CACHE.get(key)
    if ex is None:
        named = resolve_named_variables(named_variables, flat)
        mom, nest = momentum, False
        config = build_for_tf(compression)
        taken = optimizer is not None and config.corrects_momentum
        if taken:
            mom, nest = take_momentum(optimizer)
        ex = _CACHE[key] = TFGradientExchange(named, compression, communicator, momentum=mom, nesterov=nest,
                                              momentum_free=taken and mom is None)
    return ex


def take_momentum(optimizer) -> tuple:
    """Move a Keras optimizer's momentum into the compression memory: returns (momentum, nesterov)
    and sets the optimizer's momentum to 0 so it is not applied twice; (None, False) for an
    optimizer without momentum (Adam), which then keeps plain error feedback (docs/redsync.md)."""
    if not hasattr(optimizer, "momentum"):
        return None, False
    momentum = float(tf.keras.backend.get_value(optimizer.momentum)) \
        if not isinstance(optimizer.momentum, (int, float)) else float(optimizer.momentum)
    nesterov = bool(getattr(optimizer, "nesterov", False))
    optimizer.momentum = 0.0
    return momentum, nesterov


def _compression_key(compression):
    if compression is None or isinstance(compression, dict):
        try:
            return json.dumps(compression, sort_keys=True, default=str)
        except TypeError:
            return id(compression)
    return id(compression)
