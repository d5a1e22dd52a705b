"""``DistributedGradientTape``: ``tape.gradient`` returns gradients averaged across workers,
compressed on the way by the same core as the PyTorch optimizer.

Used like Horovod's, a new wrapper every step::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = rhvd.DistributedGradientTape(tape, compression={"method": "redsync", "density": 0.01})
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))

Residuals, velocities, thresholds and statistics persist across steps in one exchange per
(compression config, variables, optimizer): wrapping a new tape each step finds the same one
(``tape.exchange``). Pass ``exchange=`` to use one you hold yourself.
"""
from __future__ import annotations

import tensorflow as tf

from .exchange import build_for_tf, exchange_for


class _DistributedGradientTape(tf.GradientTape):
    def __init__(self, tape, persistent, watch_accessed_variables, settings):
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape           # the recording made by the user's `with` block
        self._rsync = settings
        self.exchange = settings.get("exchange")

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super(self.__class__, self).gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        if self.exchange is None:
            s = self._rsync
            self.exchange = exchange_for(flat_sources, s["compression"], s["named_variables"], s["optimizer"],
                                         communicator=s["communicator"])
        averaged = self.exchange(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, averaged)

    def communication_stats(self) -> dict:
        if self.exchange is None:
            raise RuntimeError("no gradient exchanged yet: call gradient() first")
        return self.exchange.communication_stats()


@tf.autograph.experimental.do_not_convert
def DistributedGradientTape(tape, compression=None, named_variables=None, optimizer=None, exchange=None,
                            communicator=None):
    """Wrap a recorded ``tf.GradientTape`` so ``gradient()`` averages across workers with compression.

    compression: the YAML ``compression:`` dict (e.g. ``{"method": "topk", "density": 0.01}``),
        a config object or a Compressor; default dense fp32 (``{"method": "none"}``).
    named_variables: ``[(name, variable)]`` or ``{name: variable}``: names used by per-layer
        overrides and statistics (default: the variables' TF names).
    optimizer: the Keras optimizer that applies the gradients; needed only with
        ``momentum_correction`` (its momentum moves into the compression memory).
    exchange: a :class:`~redsync_hvd.tensorflow.exchange.TFGradientExchange` to use.
    """
    cls = type(tape.__class__.__name__, (tape.__class__,), dict(_DistributedGradientTape.__dict__))
    settings = {"compression": compression, "named_variables": named_variables, "optimizer": optimizer,
                "exchange": exchange, "communicator": communicator}
    if exchange is None and compression is not None:
        build_for_tf(compression)   # a bad compression dict fails here, as in torch's constructor
    return cls(tape._tape, tape._persistent, tape._watch_accessed_variables, settings)
