"""Keras ``DistributedOptimizer``: ``apply_gradients`` first averages the gradients across
workers through the compression core, then applies them with your optimizer.

Like Horovod's (and the PyTorch adapter), it returns an instance of a subclass of your
optimizer's class, rebuilt from its config, so ``model.compile(optimizer=...)``,
``model.fit`` (the exchange runs in ``tf.py_function`` inside Keras' compiled train step),
learning-rate schedules and ``isinstance`` keep working. Works with Keras 2 (TF 2.15's
``tf.keras``) optimizers, new (``tf.keras.optimizers.SGD``) and legacy ones.
"""
from __future__ import annotations

from types import SimpleNamespace

import tensorflow as tf

from .exchange import TFGradientExchange, build_for_tf, resolve_named_variables


class _DistributedOptimizer:
    def _rsync_setup(self, compression, named_variables, communicator, momentum, nesterov, momentum_free):
        # a plain namespace: Keras would wrap a dict attribute into a tracking proxy
        self._rsync = SimpleNamespace(compression=compression, named_variables=named_variables,
                                      communicator=communicator, momentum=momentum, nesterov=nesterov,
                                      momentum_free=momentum_free, exchange=None, steps_per_epoch=None)

    def _rsync_exchange_for(self, variables):
        s = self._rsync
        if s.exchange is None:
            named = resolve_named_variables(s.named_variables, variables)
            s.exchange = TFGradientExchange(named, s.compression, s.communicator,
                                            momentum=s.momentum, nesterov=s.nesterov, momentum_free=s.momentum_free)
            if s.steps_per_epoch:
                s.exchange.set_steps_per_epoch(s.steps_per_epoch)
        return s.exchange

    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if grads_and_vars:
            grads, variables = zip(*grads_and_vars)
            averaged = self._rsync_exchange_for(list(variables))(list(grads), list(variables))
            grads_and_vars = list(zip(averaged, variables))
        return super(self.__class__, self).apply_gradients(grads_and_vars, *args, **kwargs)

    def set_steps_per_epoch(self, steps: int) -> None:
        """Needed by epoch-based schedules such as ``warmup_epochs``."""
        self._rsync.steps_per_epoch = int(steps)
        if self._rsync.exchange is not None:
            self._rsync.exchange.set_steps_per_epoch(steps)

    @property
    def exchange(self):
        """The :class:`~redsync_hvd.tensorflow.exchange.TFGradientExchange` (None before the first step)."""
        return self._rsync.exchange

    def communication_stats(self) -> dict:
        if self._rsync.exchange is None:
            raise RuntimeError("no gradient exchanged yet: call apply_gradients (or fit) first")
        return self._rsync.exchange.communication_stats()

    def layer_decisions(self) -> list:
        return [] if self._rsync.exchange is None else self._rsync.exchange.layer_decisions()


def DistributedOptimizer(optimizer, compression=None, named_variables=None, communicator=None):
    """Wrap a Keras optimizer so ``apply_gradients`` (and so ``minimize`` and ``model.fit``) average
    gradients across workers with compression.

    compression: the YAML ``compression:`` dict, a config object or a Compressor (default dense).
    named_variables: ``[(name, variable)]`` / ``{name: variable}`` (default: the TF variable names).
    With ``momentum_correction`` the optimizer's momentum moves into the compression memory and
    the returned optimizer has momentum 0; an optimizer without momentum (Adam) keeps plain error
    feedback instead (docs/redsync.md, "Adam and AdamW").
    """
    config = build_for_tf(compression)   # a bad compression dict fails here, before training
    conf = optimizer.get_config()
    momentum, nesterov = None, False
    momentum_free = config.corrects_momentum and "momentum" not in conf   # Adam: plain error feedback
    if config.corrects_momentum and not momentum_free:
        momentum, nesterov = float(conf["momentum"]), bool(conf.get("nesterov", False))
        conf["momentum"] = 0.0
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in _DistributedOptimizer.__dict__.items() if k not in ("__dict__", "__weakref__")})
    new = cls.from_config(conf)
    new._rsync_setup(compression, named_variables, communicator, momentum, nesterov, momentum_free)
    return new
