"""The communicators' alltoall against what every rank sent, under horovodrun or torchrun:
rank r sends ``rows(r, d)`` to rank d (zero rows for some pairs, one rank sending nothing at
all to anyone but itself), in several dtypes and with rows of more than one element.

    horovodrun -np 3 python tests/mp/alltoall.py horovod
    torchrun --nproc_per_node 3 tests/mp/alltoall.py torch
"""
import sys

import torch

from redsync_hvd.launchers import close_process_group


def count(src: int, dst: int, size: int) -> int:
    if src == size - 1:
        return 2 if dst == src else 0     # the last rank sends only to itself
    return (src + 2 * dst) % 3            # 0, 1 or 2 rows


def rows(src: int, dst: int, size: int, dtype, width: int) -> torch.Tensor:
    n = count(src, dst, size)
    base = torch.arange(n * width).reshape(n, width) + 10 * src + 3 * dst
    return base.to(dtype).squeeze(1) if width == 1 else base.to(dtype)


def check(comm) -> None:
    rank, size = comm.rank, comm.size
    for dtype in (torch.uint8, torch.int32, torch.float32, torch.float16, torch.int64):
        for width in (1, 3):
            parts = [rows(rank, d, size, dtype, width) for d in range(size)]
            handle = comm.alltoall_async(torch.cat(parts), [p.shape[0] for p in parts], name=f"a2a.{dtype}.{width}")
            got, splits = comm.wait(handle)
            expect = [rows(s, rank, size, dtype, width) for s in range(size)]
            assert splits == [e.shape[0] for e in expect], (dtype, width, splits)
            assert got.dtype == dtype and torch.equal(got, torch.cat(expect)), (dtype, width, got)
    try:
        comm.alltoall_async(torch.zeros(3), [1] * (size + 1), name="bad")
    except ValueError as exc:
        assert "splits" in str(exc), exc
    else:
        raise AssertionError("splits of the wrong length were accepted")


def main():
    engine = sys.argv[1]
    if engine == "horovod":
        import horovod.torch as hvd

        from redsync_hvd.comm import HorovodCommunicator
        hvd.init()
        comm = HorovodCommunicator(hvd)
    else:
        import torch.distributed as dist

        from redsync_hvd.comm.torch_dist import TorchDistCommunicator
        dist.init_process_group("gloo")
        comm = TorchDistCommunicator()
    check(comm)
    print(f"rank {comm.rank}: OK alltoall {engine} of {comm.size}")
    if engine != "horovod":
        close_process_group()


if __name__ == "__main__":
    main()
