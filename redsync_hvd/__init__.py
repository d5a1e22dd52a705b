"""redsync_hvd: residual gradient compression for Horovod.

Framework adapters live in ``redsync_hvd.torch`` (and ``redsync_hvd.tensorflow``);
this top level holds only the framework-neutral pieces, so importing it needs no Horovod.
"""
import os

# TensorFlow's C++ start-up lines, unless the user asked for them (redsync_hvd/_startup.py does the
# same for every Python of the project's virtualenv, horovodrun's launcher included)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"


def select_topk(x, k, method="tbs", **options):
    """Indices (int64, into ``x.flatten()``) of the k largest-magnitude elements; see
    :func:`redsync_hvd.core.select.select_topk`."""
    from .core.select import select_topk as _select
    return _select(x, k, method=method, **options)


__all__ = ["select_topk", "__version__"]
