"""TensorFlow 2 adapter: ``import redsync_hvd.tensorflow as rhvd``, used like ``horovod.tensorflow``.

    rhvd.init()
    rhvd.broadcast_variables(model.variables, root_rank=0)
    with tf.GradientTape() as tape:
        loss = ...
    tape = rhvd.DistributedGradientTape(tape, compression={"method": "redsync", "density": 0.01})
    grads = tape.gradient(loss, model.trainable_variables)

or ``model.compile(optimizer=rhvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=...))``.

One algorithm core: gradients go to torch through DLPack (no copy) and through the same
:class:`~redsync_hvd.exchange.GradientExchange`, compressors and memories as the PyTorch
adapter. Every collective of this module (gradients, ``broadcast_variables``, ``allreduce``,
the config check) runs on ``horovod.torch``'s Horovod instance, the only one ``init()`` starts.
``init(tensorflow_horovod=True)`` also starts ``horovod.tensorflow``'s own instance (a separate
one in the same process) for code that calls ``horovod.tensorflow`` directly, and checks that
both report the same rank and size. See docs/tensorflow.md.
"""
from __future__ import annotations

try:
    import tensorflow as tf
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("redsync_hvd.tensorflow needs TensorFlow: install it with "
                      "`REDSYNC_WITH_TF=1 bash scripts/install.sh` (it installs the package's [tensorflow] "
                      "extra, tensorflow-cpu==2.15.1, and rebuilds Horovod with TensorFlow; "
                      "`pip install -e .[tensorflow]` alone leaves Horovod without it)") from exc

import horovod.torch as _hvd

from .dlpack import to_tf, to_torch
from .exchange import TFGradientExchange
from .optimizer import DistributedOptimizer
from .tape import DistributedGradientTape

rank = _hvd.rank
size = _hvd.size
local_rank = _hvd.local_rank
local_size = _hvd.local_size
broadcast_object = _hvd.broadcast_object
allgather_object = _hvd.allgather_object
mpi_enabled = _hvd.mpi_enabled
is_initialized = _hvd.is_initialized

_tf_hvd = None


def init(comm=None, tensorflow_horovod: bool = False) -> None:
    """Initialise Horovod for TensorFlow programs.

    ``horovod.torch``'s instance carries every collective of redsync_hvd (the algorithm core is
    torch), so it is all a program that calls only ``redsync_hvd`` needs. With
    ``tensorflow_horovod=True`` ``horovod.tensorflow`` is initialised too, with the same ``comm``,
    for programs that also call ``horovod.tensorflow`` themselves (its Keras callbacks, its
    ``allreduce`` on TF tensors); both must agree on rank and size. The second instance costs a
    background thread that polls MPI, and a process holding both has been seen to segfault at
    exit (docs/tensorflow.md, "Known issue"), so it is off unless asked for.
    """
    global _tf_hvd
    if comm is None:
        _hvd.init()
    else:
        _hvd.init(comm)
    if tensorflow_horovod:
        try:
            import horovod.tensorflow as hvd_tf
        except ImportError as exc:
            raise ImportError("horovod.tensorflow is not importable: Horovod was built without TensorFlow. "
                              "Rebuild with `REDSYNC_WITH_TF=1 bash scripts/install.sh`, or call "
                              "init(tensorflow_horovod=False) to use only horovod.torch's instance") from exc
        if comm is None:
            hvd_tf.init()
        else:
            hvd_tf.init(comm)
        mine, theirs = (_hvd.rank(), _hvd.size()), (hvd_tf.rank(), hvd_tf.size())
        if mine != theirs:
            raise RuntimeError(f"horovod.torch says (rank, size)={mine} but horovod.tensorflow says {theirs}: "
                               "both must be started by the same launcher (horovodrun / mpirun)")
        _tf_hvd = hvd_tf


def shutdown() -> None:
    if _tf_hvd is not None:
        _tf_hvd.shutdown()
    _hvd.shutdown()


def broadcast_variables(variables, root_rank: int = 0) -> None:
    """Overwrite every rank's ``variables`` with ``root_rank``'s (through horovod.torch).

    Call it after the variables exist (after the model was built and, for optimizer slots, after
    the optimizer was built). Every rank must pass the same variables in the same order.
    """
    _eager_only("broadcast_variables")
    variables = list(variables)
    handles = []
    for i, v in enumerate(variables):
        t = to_torch(tf.convert_to_tensor(v))
        handles.append(_hvd.broadcast_async(t, root_rank=root_rank, name=f"rsync.tf_broadcast.{i}"))
    for v, h in zip(variables, handles):
        v.assign(to_tf(_hvd.synchronize(h)))


def allreduce(tensor, average: bool = True, name: str | None = None):
    """Allreduce a TF tensor (e.g. metric sums) through horovod.torch; returns a TF tensor."""
    _eager_only("allreduce")
    t = to_torch(tf.convert_to_tensor(tensor))
    op = _hvd.Average if average else _hvd.Sum
    return to_tf(_hvd.allreduce(t, op=op, name=name))


def _eager_only(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"redsync_hvd.tensorflow.{what} runs eagerly (it hands tensors to horovod.torch); call it "
                           "outside tf.function, or use horovod.tensorflow's op inside graphs")


__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "broadcast_variables",
           "broadcast_object", "allgather_object", "allreduce", "DistributedGradientTape",
           "DistributedOptimizer", "TFGradientExchange", "mpi_enabled", "is_initialized", "to_torch", "to_tf"]
