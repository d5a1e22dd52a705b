"""Horovod as the transport for the PyTorch path.

Thin on purpose: names every collective so Horovod can match them across ranks
(and fuse concurrent ones), and keeps asynchronous handles opaque to the core.
"""
from __future__ import annotations

import torch


class _Alltoall:
    """An alltoall's Horovod handle: ``wait`` turns its (tensor, splits tensor) into (tensor, list)."""
    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle


class HorovodCommunicator:
    def __init__(self, hvd=None):
        if hvd is None:
            import horovod.torch as hvd  # noqa: WPS433 (import on demand: tests of the core need no Horovod)
        self.hvd = hvd

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def size(self) -> int:
        return self.hvd.size()

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool = True):
        op = self.hvd.Average if average else self.hvd.Sum
        return self.hvd.allreduce_async(tensor, name=name, op=op)

    def allgather_async(self, tensor: torch.Tensor, name: str, sizes: list | None = None):
        """``sizes`` (every rank's first dimension) is not needed: Horovod exchanges them itself."""
        return self.hvd.allgather_async(tensor, name=name)

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str):
        return self.hvd.broadcast_async(tensor, root_rank=root, name=name)

    def alltoall_async(self, tensor: torch.Tensor, splits: list, name: str):
        """Rows ``sum(splits[:i]) .. sum(splits[:i+1])`` of ``tensor`` go to rank i; ``wait`` returns
        (every rank's rows for this rank, concatenated in rank order; how many rows each sent).
        Horovod exchanges the split sizes itself, in the same collective."""
        if len(splits) != self.size or sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name!r}: splits {list(splits)} must have {self.size} entries that add "
                             f"up to the tensor's first dimension {tensor.shape[0]}")
        return _Alltoall(self.hvd.alltoall_async(tensor, splits=torch.tensor(splits, dtype=torch.int32), name=name))

    def wait(self, handle) -> torch.Tensor:
        if isinstance(handle, _Alltoall):
            received, received_splits = self.hvd.synchronize(handle.handle)
            return received, [int(n) for n in received_splits.tolist()]
        return self.hvd.synchronize(handle)

    def allgather_object(self, obj, name: str):
        return self.hvd.allgather_object(obj, name=name)

    def allreduce_async_(self, tensor: torch.Tensor, name: str, average: bool = True):
        """In place: the result overwrites ``tensor`` (no output allocation)."""
        op = self.hvd.Average if average else self.hvd.Sum
        return self.hvd.allreduce_async_(tensor, name=name, op=op)
