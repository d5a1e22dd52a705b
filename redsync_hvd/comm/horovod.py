"""Horovod as the transport for the PyTorch path.

Thin on purpose: names every collective so Horovod can match them across ranks
(and fuse concurrent ones), and keeps asynchronous handles opaque to the core.
"""
from __future__ import annotations

import torch


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

    def wait(self, handle) -> torch.Tensor:
        return self.hvd.synchronize(handle)

    def allgather_object(self, obj, name: str):
        return self.hvd.allgather_object(obj, name=name)

    def allreduce_async_(self, tensor: torch.Tensor, name: str, average: bool = True):
        """In place: the result overwrites ``tensor`` (no output allocation)."""
        op = self.hvd.Average if average else self.hvd.Sum
        return self.hvd.allreduce_async_(tensor, name=name, op=op)
