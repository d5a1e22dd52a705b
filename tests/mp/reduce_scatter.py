"""The sparse reduce-scatter of one bucket (redsync_hvd/exchange/reduce_scatter.py) across real
processes, against a dense reference computed in this process from every rank's messages:

    sum S = every rank's (position, value) pairs added into dense layers; each owner keeps the
    ceil(k/N) largest |S| among the positions of its region that some rank sent; the update is
    S there, divided by N; each rank gets back what it sent at positions nobody kept.

Codecs: fp32 pairs, fp16 pairs (the owner keeps the rounding error), sign-mean (one mean per
layer), int8 codes with a scale per layer (the owner's re-coding keeps its rounding error too),
and fp16, int8 and sign-mean with Golomb-coded positions (fewer bytes for the same entries),
after the communicator's own alltoall check (tests/mp/alltoall.py). Layers: one smaller than N,
one with a cluster of large values, one where one rank sends nothing. Several steps with
different k. Then conservation over the steps: what was applied plus what came back equals
what was sent.

    horovodrun -np 3 python tests/mp/reduce_scatter.py horovod
    torchrun --nproc_per_node 3 tests/mp/reduce_scatter.py torch
"""
import sys

import torch
from alltoall import check as check_alltoall

from redsync_hvd.compressors.codec import MessageCodec
from redsync_hvd.exchange.reduce_scatter import SparseReduceScatter, allgather, wait_allgather
from redsync_hvd.exchange.regions import Regions
from redsync_hvd.launchers import close_process_group

NUMELS = [3, 500, 2000]


def message(rank: int, step: int, layer: int, n: int, k: int, codec: str):
    """A rank's (positions, values) for one layer: distinct positions, distinct values; layer 2
    sends its large values in one band; rank 1 sends nothing for layer 1 at odd steps. int8:
    values are (codes, scale); golomb: in order of position."""
    gen = torch.Generator().manual_seed(1000 * step + 100 * rank + layer)
    if layer == 1 and rank == 1 and step % 2:
        pos = torch.zeros(0, dtype=torch.int64)
    elif layer == 2:
        pos = torch.randperm(n // 8, generator=gen)[:k] + n // 2   # a cluster
    else:
        pos = torch.randperm(n, generator=gen)[:k]
    if "golomb" in codec:
        pos = torch.sort(pos).values
    vals = torch.randn(pos.numel(), generator=gen, dtype=torch.float64).float()
    if codec.startswith("sign_mean"):
        mean = vals.abs().mean() if vals.numel() else torch.zeros(())
        return pos, mean.reshape(1) * (1 if step % 2 == 0 else -1)
    if codec.startswith("int8"):
        return pos, tuple(MessageCodec("int8").to_wire(vals))
    return pos, vals.to(torch.float16) if codec.startswith("fp16") else vals


def worth(vals, codec: str) -> torch.Tensor:
    """The fp32 values a message stands for."""
    return vals[0].float() * vals[1] if codec.startswith("int8") else vals.float()


def owner_wire(total: torch.Tensor, kept: torch.Tensor, codec: str) -> torch.Tensor:
    """What one owner's kept fp32 sums of one layer travel as in step 5, as fp32."""
    if codec.startswith("int8"):
        codes, scale = MessageCodec("int8").to_wire(total[kept])
        return codes.float() * scale
    return total[kept].half().float() if codec.startswith("fp16") else total[kept]


def reference(msgs: list, ks: list, size: int, codec: str):
    """(averages per layer, carry per rank and layer as dense tensors) from every rank's messages;
    each owner's sum in fp32, rank after rank, as its index_add_ adds them."""
    averages, carries = [], [[] for _ in range(size)]
    for l, n in enumerate(NUMELS):
        total, sent = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.bool)
        dense_msgs = []
        for r in range(size):
            pos, vals = msgs[r][l]
            d = torch.zeros(n, dtype=torch.float32)
            d[pos] = vals.float().expand(pos.numel()) if codec.startswith("sign_mean") else worth(vals, codec)
            dense_msgs.append(d.double())
            total += d
            sent[pos] = True
        owner = Regions.of(n, size).owners(torch.arange(n))
        keep = -(-ks[l] // size)
        applied, wire = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.float32)
        for o in range(size):
            cand = torch.nonzero(sent & (owner == o)).reshape(-1)
            if cand.numel() > keep:
                cand = cand[torch.topk(total[cand].abs(), keep).indices]
            applied[cand] = True
            wire[cand] = owner_wire(total, cand, codec)
        averages.append(torch.where(applied, wire.double(), 0.0) / size)
        for r in range(size):   # the owner of each kept position keeps what its wire rounded off
            back = torch.where(applied, 0.0, dense_msgs[r])
            carries[r].append(back + torch.where(applied & (owner == r), (total - wire).double(), 0.0))
    return averages, carries


def dense_carry(carry: list) -> list:
    out = []
    for (pos, vals), n in zip(carry, NUMELS):
        d = torch.zeros(n, dtype=torch.float64)
        d.index_add_(0, pos, vals.double())
        out.append(d)
    return out


def run(comm, codec: str) -> None:
    rank, size = comm.rank, comm.size
    value_dtype = {"fp16": torch.float16, "int8": torch.int8}.get(codec.split("_")[0], torch.float32)
    rsc = SparseReduceScatter(comm, NUMELS, f"test.{codec}", value_dtype, sign_mean=codec.startswith("sign_mean"),
                              index_coding="golomb" if "golomb" in codec else "raw")
    sent_total, applied_total, back_total = 0.0, 0.0, 0.0
    for step, density in enumerate([1.0, 0.2, 0.05, 0.05]):
        ks = [max(1, min(n, round(density * n))) for n in NUMELS]
        msgs = [[message(r, step, l, n, min(ks[l], n // 8 if l == 2 else n), codec) for l, n in enumerate(NUMELS)]
                for r in range(size)]
        scaled = codec.startswith("int8")
        pending = rsc.start([p for p, _ in msgs[rank]], [v[0] if scaled else v for _, v in msgs[rank]], ks,
                            [v[1] for _, v in msgs[rank]] if scaled else None)
        rsc.reduce(pending)
        wait_allgather(comm, allgather(comm, [pending], f"test.{codec}.ag"), [pending])
        got = rsc.finish(pending)
        averages, carries = reference(msgs, ks, size, codec)
        tol = 1e-5
        for l in range(len(NUMELS)):
            assert torch.allclose(got.averages[l].double(), averages[l], atol=tol, rtol=tol), (codec, step, l)
            assert torch.allclose(dense_carry(got.carry)[l], carries[rank][l], atol=tol, rtol=tol), (codec, step, l)
        mine = sum(float(v.double().sum()) * p.numel() if codec.startswith("sign_mean") else
                   float(worth(v, codec).double().sum()) for p, v in msgs[rank])
        sent_total += mine
        applied_total += sum(float(a.double().sum()) for a in got.averages)   # the same on every rank
        back_total += sum(float(v.double().sum()) for _, v in got.carry)
        if not rsc.coded:   # coded pieces differ in size per owner
            assert got.bytes["allgather_received"] == (size - 1) * got.bytes["allgather_sent"], got.bytes
        coded_bytes[codec] = coded_bytes.get(codec, 0) + got.bytes["alltoall_sent"] + got.bytes["allgather_sent"]
    everyone = comm.allgather_object((sent_total, back_total), name=f"test.{codec}.totals")
    sent_all, back_all = (sum(t[i] for t in everyone) for i in (0, 1))
    assert abs(size * applied_total + back_all - sent_all) < 1e-2 * max(1.0, abs(sent_all)), \
        (codec, size * applied_total, back_all, sent_all)


CODECS = ("fp32", "fp16", "sign_mean", "int8", "fp16_golomb", "int8_golomb", "sign_mean_golomb")
coded_bytes = {}


def check_bucket(comm) -> None:
    check_alltoall(comm)
    for codec in CODECS:
        run(comm, codec)
    # the same entries cost fewer bytes coded: int8 values, then Golomb positions on top
    assert coded_bytes["int8"] < coded_bytes["fp16"] and coded_bytes["fp16_golomb"] < coded_bytes["fp16"], coded_bytes
    assert coded_bytes["int8_golomb"] < coded_bytes["int8"], coded_bytes


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
    check_bucket(comm)
    print(f"rank {comm.rank}: OK sparse reduce-scatter {engine} of {comm.size}")
    if engine != "horovod":
        close_process_group()


if __name__ == "__main__":
    main()
