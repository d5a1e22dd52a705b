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
                  "allgather_object", "allreduce", "allgather", "broadcast", "mpi_enabled", "shutdown", "Sum",
                  "Average", "Adasum", "add_process_set", "remove_process_set", "ProcessSet", "global_process_set")


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


def broadcast_optimizer_state(optimizer, root_rank: int = 0, model=None, *, initialize: bool = True) -> None:
    """Broadcast the wrapped optimizer's state (momentum buffers, step counts, lr) from ``root_rank``.

    As horovod.torch's: an optimizer whose state is still empty first takes one step on zero
    gradients (sparse ones under SparseAdam, and for ``model``'s sparse embeddings), with the
    wrapped optimizer alone (no exchange), so the state exists on every rank; trainable
    parameters keep those zero gradients. That step moves the weights where the optimizer
    decays them: ``initialize=False`` leaves an empty state empty (only the param groups
    travel), as the YAML runner and :class:`~redsync_hvd.torch.elastic.ElasticState` do.

    Residuals and other compression state are per-worker and are *not* broadcast: copying
    rank 0's residual to everyone would send it N times. To resume, let every rank load its
    own checkpoint (``train.py`` writes one per rank).
    """
    hvd = _horovod()
    ours = hasattr(optimizer, "_exchange") or hasattr(optimizer, "_algo")
    if not ours and initialize:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank, model=model)
        return
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if initialize and not optimizer.state:
        _first_state(optimizer, model)
    # The whole dict as one object: simpler than Horovod's per-tensor broadcast, same values
    base = torch.optim.Optimizer.state_dict(optimizer)
    base = hvd.broadcast_object(base, root_rank=root_rank, name="rsync.optimizer_state")
    torch.optim.Optimizer.load_state_dict(optimizer, base)


def _first_state(optimizer, model) -> None:
    """One step of the wrapped optimizer alone on zero gradients, as horovod.torch initialises an
    empty state (a step of ours would start an exchange, which other ranks might not join)."""
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or \
                        (isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    super(optimizer.__class__, optimizer).step()
    if hasattr(optimizer, "_attach"):
        optimizer._attach()   # the zeros move into the exchange's buffers, where backward writes


__all__ = [*_HOROVOD_NAMES, "broadcast_optimizer_state", "DistributedOptimizer", "DecentralizedOptimizer"]
