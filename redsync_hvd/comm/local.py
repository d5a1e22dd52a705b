"""A one-process stand-in for the transport, for benchmarks and single-process runs.

``LocalCommunicator(size=N)`` behaves as if N ranks all sent what this process sends:
allreduce-average returns the input, allgather returns N copies, broadcast returns the
input, alltoall returns N copies of the rows this process addressed to rank 0. The exchange
then does exactly the per-rank work it does in a real N-worker job (compress once, decode N
messages), with no network and no Horovod, so ``scripts/bench_overhead.py`` can time the
compression overhead on any machine, a lone GPU included. It moves no data between
processes: use :class:`~redsync_hvd.comm.HorovodCommunicator` for training.
"""
from __future__ import annotations

import torch


class LocalCommunicator:
    def __init__(self, size: int = 1):
        if size < 1:
            raise ValueError(f"LocalCommunicator size must be >= 1, got {size}")
        self._size = int(size)

    rank = 0

    @property
    def size(self) -> int:
        return self._size

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool = True):
        return tensor.clone() if average else tensor * self._size

    def allreduce_async_(self, tensor: torch.Tensor, name: str, average: bool = True):
        return tensor if average else tensor.mul_(self._size)

    def allgather_async(self, tensor: torch.Tensor, name: str, sizes: list | None = None):
        return torch.cat([tensor] * self._size)

    def is_root(self, root: int) -> bool:
        """True for every ``root``: each of the N ranks is this process, so what a root would send
        is what this process computes as that root (IWP's leader selects here, whoever it is)."""
        return True

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str):
        return tensor.clone()

    def alltoall_async(self, tensor: torch.Tensor, splits: list, name: str):
        """Rank 0's share of every rank's rows: N copies of this process's rows for rank 0."""
        if len(splits) != self._size or sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name!r}: splits {list(splits)} must have {self._size} entries that add "
                             f"up to the tensor's first dimension {tensor.shape[0]}")
        mine = tensor[:splits[0]]
        return torch.cat([mine] * self._size), [int(splits[0])] * self._size

    def wait(self, handle) -> torch.Tensor:
        return handle

    def allgather_object(self, obj, name: str):
        return [obj] * self._size
