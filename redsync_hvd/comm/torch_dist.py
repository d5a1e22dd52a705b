"""torch.distributed as the transport: the Horovod communicator's interface over Gloo or NCCL.

Same methods as :class:`~redsync_hvd.comm.HorovodCommunicator` (``rank``, ``size``,
``allreduce_async``, ``allreduce_async_``, ``allgather_async``, ``alltoall_async``,
``broadcast_async``, ``wait``, ``allgather_object``), so the exchange runs unchanged under ``torchrun``;
and ``reduce_scatter_async``, the collective of FSDP's sharded training (exchange/sharded.py).

Two differences from Horovod shape the code:

* **Order, not names.** Horovod matches collectives across ranks by name; torch.distributed
  matches them by the order in which each rank issues them. Every rank must start the
  same collectives in the same order (the exchange and DDP's hooks do: both follow a
  fixed layer and bucket order). ``name`` is kept for the interface and for error messages.
* **Equal sizes.** Horovod's allgather takes a different first dimension on every rank;
  torch's single-tensor allgather does not. :meth:`allgather_async` therefore
  1. allgathers the first dimensions (a small blocking collective: the padded size must
     be known before the data collective starts, and starting it later, inside ``wait``,
     would break the common order of collectives across ranks),
  2. pads its tensor to the largest size and starts one asynchronous allgather,
  3. cuts the padding out in :meth:`wait`.

Collectives are asynchronous (``async_op=True`` work handles) and resolved in
:meth:`wait`; averaging is a sum followed by a division there, because Gloo has no
average reduction. Tensors travel on the backend's device (CPU for Gloo, the current
CUDA device for NCCL) and results come back on the caller's device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _Pending:
    """An asynchronous collective: its work handle, its output, and what ``wait`` does last."""
    __slots__ = ("work", "result", "finish")

    def __init__(self, work, result: torch.Tensor, finish=None):
        self.work = work
        self.result = result
        self.finish = finish


class TorchDistCommunicator:
    def __init__(self, process_group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (CUDA) "
                               "first; under torchrun the rank and world size come from the environment")
        self.group = process_group
        self._rank = dist.get_rank(process_group)
        self._size = dist.get_world_size(process_group)
        if self._rank < 0:
            raise ValueError("this process is not a member of the given process_group: pass a group that "
                             "contains every rank that calls the communicator")
        self.backend = str(dist.get_backend(process_group)).lower()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" \
            else torch.device("cpu")
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    # -- collectives ---------------------------------------------------------
    def allreduce_async(self, tensor: torch.Tensor, name: str, average: bool = True):
        """Sum (or average) over ranks into a new tensor; ``tensor`` is left as it was."""
        buf = tensor.detach().to(self.device, copy=True).contiguous()
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        return _Pending(work, buf, self._finish_reduce(tensor.device, average))

    def allreduce_async_(self, tensor: torch.Tensor, name: str, average: bool = True):
        """In place: the result overwrites ``tensor`` (staged through a copy only when the tensor
        is not contiguous or not on the backend's device)."""
        if tensor.device == self.device and tensor.is_contiguous():
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
            return _Pending(work, tensor, self._finish_reduce(tensor.device, average))
        buf = tensor.detach().to(self.device, copy=True).contiguous()
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        reduce = self._finish_reduce(self.device, average)
        return _Pending(work, buf, lambda out: tensor.copy_(reduce(out)))

    # the first dimensions of an allgather must be known before its data collective starts
    needs_sizes = True

    def allgather_async(self, tensor: torch.Tensor, name: str, sizes: list | None = None):
        """Concatenate every rank's tensor along the first dimension, whose length may differ
        per rank (zero included), as Horovod's allgather does. ``sizes``: every rank's first
        dimension where the caller knows them (a fixed-size header, or sizes a header gave):
        then no collective of sizes comes first."""
        if tensor.dim() == 0:
            raise ValueError(f"allgather {name!r}: a 0-d tensor has no first dimension to concatenate "
                             "along; reshape it to (1,)")
        local = tensor.detach().to(self.device).contiguous()
        if sizes is not None and sizes[self._rank] != local.shape[0]:
            raise RuntimeError(f"allgather {name!r}: this rank's tensor has {local.shape[0]} rows but the sizes "
                               f"given say {sizes[self._rank]}: ranks disagree on the message layout")
        sizes = list(sizes) if sizes is not None else self._first_dims(local.shape[0])
        longest = max(sizes)
        if local.shape[0] < longest:
            padded = local.new_zeros((longest,) + tuple(local.shape[1:]))
            padded[:local.shape[0]] = local
            local = padded
        out = local.new_empty((self._size * longest,) + tuple(local.shape[1:]))
        work = self._gather(out, local, group=self.group, async_op=True)
        home = tensor.device

        def trim(gathered: torch.Tensor) -> torch.Tensor:
            if any(s != longest for s in sizes):
                gathered = torch.cat([gathered[r * longest:r * longest + s] for r, s in enumerate(sizes)])
            return gathered.to(home)
        return _Pending(work, out, trim)

    def alltoall_async(self, tensor: torch.Tensor, splits: list, name: str):
        """Rows ``sum(splits[:i]) .. sum(splits[:i+1])`` of ``tensor`` go to rank i; ``wait`` returns
        (every rank's rows for this rank, concatenated in rank order; how many rows each sent).

        1. the split sizes travel first, in a small blocking alltoall (``all_to_all_single`` needs
           the output sizes before it starts, and starting it later would break the common order);
        2. one asynchronous ``all_to_all_single`` moves the rows."""
        if len(splits) != self._size or sum(splits) != tensor.shape[0]:
            raise ValueError(f"alltoall {name!r}: splits {list(splits)} must have {self._size} entries that add "
                             f"up to the tensor's first dimension {tensor.shape[0]}")
        local = tensor.detach().to(self.device).contiguous()
        mine = torch.tensor(list(splits), dtype=torch.int64, device=self.device)
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine, group=self.group)                               # 1.
        received = theirs.tolist()
        out = local.new_empty((sum(received),) + tuple(local.shape[1:]))
        work = dist.all_to_all_single(out, local, output_split_sizes=received, input_split_sizes=list(splits),
                                      group=self.group, async_op=True)                       # 2.
        home = tensor.device
        return _Pending(work, out, lambda got: (got.to(home), received))

    def reduce_scatter_async(self, tensor: torch.Tensor, name: str, average: bool = True,
                             out: torch.Tensor | None = None):
        """Rank i gets the sum (or average) over ranks of the i-th of ``size`` equal pieces of the
        flat ``tensor``, in ``out`` (or a new tensor): one ``reduce_scatter_single``, the call
        FSDP2 makes for its own reduce-scatter, so a dense group reduces bit for bit as FSDP's."""
        flat = tensor.detach().reshape(-1)
        if flat.numel() % self._size:
            raise ValueError(f"reduce_scatter {name!r}: {flat.numel()} elements do not split into {self._size} "
                             "equal pieces; pad the tensor to a multiple of the world size")
        local = flat.to(self.device).contiguous()
        result = out if out is not None and out.device == self.device else \
            local.new_empty(flat.numel() // self._size)
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        work = dist.reduce_scatter_single(output=result, input=local, op=op, group=self.group, async_op=True)
        if out is None or out is result:
            return _Pending(work, result, None if out is not None else (lambda got: got.to(tensor.device)))
        return _Pending(work, result, lambda got: out.copy_(got))

    def is_root(self, root: int) -> bool:
        """Whether a broadcast from ``root`` (a rank within the group) sends this process's tensor."""
        return root == self._rank

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str):
        """``root``'s tensor on every rank, in a new tensor. ``root`` is a rank of the group."""
        if not 0 <= root < self._size:
            raise ValueError(f"broadcast {name!r}: root {root} is not a rank of this group of {self._size}")
        buf = tensor.detach().to(self.device, copy=True).contiguous()
        src = root if self.group is None else dist.get_global_rank(self.group, root)
        work = dist.broadcast(buf, src=src, group=self.group, async_op=True)
        home = tensor.device
        return _Pending(work, buf, lambda out: out.to(home))

    def wait(self, handle) -> torch.Tensor:
        if handle.work is not None:
            handle.work.wait()
        return handle.finish(handle.result) if handle.finish is not None else handle.result

    def allgather_object(self, obj, name: str):
        out = [None] * self._size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    # -- helpers -------------------------------------------------------------
    def _first_dims(self, n: int) -> list:
        mine = torch.tensor([n], dtype=torch.int64, device=self.device)
        every = mine.new_empty(self._size)
        self._gather(every, mine, group=self.group)
        return every.tolist()

    def _finish_reduce(self, home: torch.device, average: bool):
        size = self._size

        def finish(out: torch.Tensor) -> torch.Tensor:
            if average:
                if out.is_floating_point() or out.is_complex():
                    out.div_(size)
                else:   # integers: truncating division, as Horovod's Average
                    out.copy_(torch.div(out, size, rounding_mode="trunc"))
            return out if out.device == home else out.to(home)
        return finish
