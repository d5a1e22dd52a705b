"""PyTorch adapter: ``import redsync_hvd.torch as rhvd``, used like ``horovod.torch``."""
from __future__ import annotations

import horovod.torch as _hvd
import torch

from .decentralized import DecentralizedOptimizer
from .optimizer import DistributedOptimizer

init = _hvd.init
rank = _hvd.rank
size = _hvd.size
local_rank = _hvd.local_rank
local_size = _hvd.local_size
broadcast_parameters = _hvd.broadcast_parameters
broadcast_object = _hvd.broadcast_object
allgather_object = _hvd.allgather_object
allreduce = _hvd.allreduce
mpi_enabled = _hvd.mpi_enabled
shutdown = _hvd.shutdown
Sum = _hvd.Sum
Average = _hvd.Average


def broadcast_optimizer_state(optimizer, root_rank: int = 0) -> None:
    """Broadcast the wrapped optimizer's state (momentum buffers, step counts, lr) from ``root_rank``.

    Residuals and other compression state are per-worker and are *not* broadcast:
    copying rank 0's residual to everyone would send it N times. To resume, let
    every rank load its own checkpoint (``train.py`` writes one per rank).
    """
    if not (hasattr(optimizer, "_exchange") or hasattr(optimizer, "_algo")):
        _hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
        return
    # The whole dict as one object: simpler than Horovod's per-tensor broadcast, which would
    # initialise empty state by calling step() (a full exchange) on our optimizer.
    base = torch.optim.Optimizer.state_dict(optimizer)
    base = _hvd.broadcast_object(base, root_rank=root_rank, name="rsync.optimizer_state")
    torch.optim.Optimizer.load_state_dict(optimizer, base)


__all__ = ["init", "rank", "size", "local_rank", "local_size", "broadcast_parameters",
           "broadcast_optimizer_state", "broadcast_object", "allgather_object", "allreduce",
           "DistributedOptimizer", "DecentralizedOptimizer", "mpi_enabled", "shutdown", "Sum", "Average"]
