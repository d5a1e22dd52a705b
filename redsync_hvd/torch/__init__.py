"""PyTorch adapter: ``import redsync_hvd.torch as rhvd``, used like ``horovod.torch``.

Horovod is imported on first use of one of its functions (``rhvd.init``, ``rhvd.rank``, ...),
not with this package, so ``redsync_hvd.torch.ddp`` (torch.distributed under torchrun) works
where Horovod is not installed.
"""
from __future__ import annotations

import importlib

import torch

from .decentralized import DecentralizedOptimizer
from .optimizer import DistributedOptimizer

# horovod.torch's functions and constants, re-exported under the same names
_HOROVOD_NAMES = ("init", "rank", "size", "local_rank", "local_size", "broadcast_parameters", "broadcast_object",
                  "allgather_object", "allreduce", "mpi_enabled", "shutdown", "Sum", "Average")


def _horovod():
    try:
        return importlib.import_module("horovod.torch")
    except ImportError as exc:
        raise ImportError(f"redsync_hvd.torch's Horovod functions need Horovod with PyTorch support ({exc}). "
                          "Install it (scripts/install.sh builds it), or train under torchrun with "
                          "redsync_hvd.torch.ddp.register, which needs no Horovod") from exc


def __getattr__(name: str):
    if name in _HOROVOD_NAMES:
        value = getattr(_horovod(), name)
        globals()[name] = value   # later look-ups find it without this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    """Broadcast the wrapped optimizer's state (momentum buffers, step counts, lr) from ``root_rank``.

    Residuals and other compression state are per-worker and are *not* broadcast:
    copying rank 0's residual to everyone would send it N times. To resume, let
    every rank load its own checkpoint (``train.py`` writes one per rank).
    """
    hvd = _horovod()
    if not (hasattr(optimizer, "_exchange") or hasattr(optimizer, "_algo")):
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
        return
    # The whole dict as one object: simpler than Horovod's per-tensor broadcast, which would
    # initialise empty state by calling step() (a full exchange) on our optimizer.
    base = torch.optim.Optimizer.state_dict(optimizer)
    base = hvd.broadcast_object(base, root_rank=root_rank, name="rsync.optimizer_state")
    torch.optim.Optimizer.load_state_dict(optimizer, base)


__all__ = [*_HOROVOD_NAMES, "broadcast_optimizer_state", "DistributedOptimizer", "DecentralizedOptimizer"]
