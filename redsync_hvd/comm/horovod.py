"""Horovod as the transport for the PyTorch path.

Thin on purpose: names every collective so Horovod can match them across ranks
(and fuse concurrent ones), and keeps asynchronous handles opaque to the core.

With a ``process_set`` (``hvd.add_process_set``) every collective runs among that set's
ranks only, and ``rank``/``size`` are this process's place in the set and the set's size, so
the exchange above sees a world of the set's size. Ranks passed as roots (``broadcast_async``)
are ranks within the set, as ``rank`` is.
"""
from __future__ import annotations

import pickle

import torch


class _Alltoall:
    """An alltoall's Horovod handle: ``wait`` turns its (tensor, splits tensor) into (tensor, list)."""
    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle


class HorovodCommunicator:
    def __init__(self, hvd=None, process_set=None):
        if hvd is None:
            import horovod.torch as hvd  # noqa: WPS433 (import on demand: tests of the core need no Horovod)
        self.hvd = hvd
        # None: Horovod's global set, whose calls take no process_set (the calls every other path makes)
        self.process_set = None if process_set is None or process_set.process_set_id == 0 else process_set
        self._set = {} if self.process_set is None else {"process_set": self.process_set}

    @property
    def rank(self) -> int:
        return self.hvd.rank() if self.process_set is None else self.process_set.rank()

    @property
    def size(self) -> int:
        return self.hvd.size() if self.process_set is None else self.process_set.size()

    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool = True):
        op = self.hvd.Average if average else self.hvd.Sum
        return self.hvd.allreduce_async(tensor, name=name, op=op, **self._set)

    def allgather_async(self, tensor: torch.Tensor, name: str, sizes: list | None = None):
        """``sizes`` (every rank's first dimension) is not needed: Horovod exchanges them itself."""
        return self.hvd.allgather_async(tensor, name=name, **self._set)

    def is_root(self, root: int) -> bool:
        """Whether a broadcast from ``root`` (a rank within the set) sends this process's tensor."""
        return root == self.rank

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str):
        # Horovod names the root by its global rank, also within a process set
        root_rank = root if self.process_set is None else self.process_set.ranks[root]
        return self.hvd.broadcast_async(tensor, root_rank=root_rank, name=name, **self._set)

    def alltoall_async(self, tensor: torch.Tensor, splits: list, name: str):
        """Rows ``sum(splits[:i]) .. sum(splits[:i+1])`` of ``tensor`` go to rank i; ``wait`` returns
        (every rank's rows for this rank, concatenated in rank order; how many rows each sent).
        Horovod exchanges the split sizes itself, in the same collective."""
        if len(splits) != self.size or sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name!r}: splits {list(splits)} must have {self.size} entries that add "
                             f"up to the tensor's first dimension {tensor.shape[0]}")
        return _Alltoall(self.hvd.alltoall_async(tensor, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                                 **self._set))

    def wait(self, handle) -> torch.Tensor:
        if isinstance(handle, _Alltoall):
            received, received_splits = self.hvd.synchronize(handle.handle)
            return received, [int(n) for n in received_splits.tolist()]
        return self.hvd.synchronize(handle)

    def allgather_object(self, obj, name: str):
        if self.process_set is None:
            return self.hvd.allgather_object(obj, name=name)
        # Horovod 0.28's allgather_object has no process_set: the same two allgathers, within the set
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.wait(self.allgather_async(torch.tensor([data.numel()]), name=f"{name}.sz")).tolist()
        gathered = self.wait(self.allgather_async(data, name=f"{name}.t")).numpy().tobytes()
        starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return [pickle.loads(gathered[a:b]) for a, b in zip(starts, starts[1:])]

    def allreduce_async_(self, tensor: torch.Tensor, name: str, average: bool = True):
        """In place: the result overwrites ``tensor`` (no output allocation)."""
        op = self.hvd.Average if average else self.hvd.Sum
        return self.hvd.allreduce_async_(tensor, name=name, op=op, **self._set)
