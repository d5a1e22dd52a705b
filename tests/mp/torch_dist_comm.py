"""The torch.distributed communicator under torchrun (Gloo), against what each rank sent:
allgather with a different first dimension per rank (zero included) in several dtypes,
allreduce (sum, average, in place, non-contiguous), broadcast from every root, objects;
then the exchange's bucketed allgather path (top-k, two buckets) over it."""
import torch
import torch.distributed as dist

from redsync_hvd.comm.torch_dist import TorchDistCommunicator
from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.exchange import GradientExchange
from redsync_hvd.launchers import close_process_group
from redsync_hvd.policy import LayerPolicy


def rows(r: int, dtype) -> torch.Tensor:
    n = 3 * r + (r % 2) * 2     # rank 0 sends nothing
    return (torch.arange(n * 2) + 100 * r).reshape(n, 2).to(dtype)


def collectives(comm):
    rank, size = comm.rank, comm.size
    for dtype in (torch.float32, torch.int32, torch.uint8, torch.float16):
        handle = comm.allgather_async(rows(rank, dtype), name=f"g.{dtype}")
        got = comm.wait(handle)
        assert torch.equal(got, torch.cat([rows(r, dtype) for r in range(size)])), (dtype, got)
    x = torch.full((5,), float(rank + 1))
    assert comm.wait(comm.allreduce_async(x, name="s", average=False)).tolist() == [size * (size + 1) / 2] * 5
    assert x.tolist() == [rank + 1.0] * 5, "allreduce_async changed its input"
    avg = comm.wait(comm.allreduce_async_(x, name="a"))
    assert avg.data_ptr() == x.data_ptr() and x.tolist() == [(size + 1) / 2] * 5
    strided = torch.arange(12.0).reshape(3, 4).t()[1]     # not contiguous
    comm.wait(comm.allreduce_async_(strided, name="nc", average=False))
    assert strided.tolist() == [size * v for v in (1.0, 5.0, 9.0)], strided
    for root in range(size):
        b = comm.wait(comm.broadcast_async(torch.tensor([rank, 7 * rank]), root=root, name="b"))
        assert b.tolist() == [root, 7 * root], (root, b)
    assert comm.allgather_object({"r": rank}, name="o") == [{"r": r} for r in range(size)]


def uneven_exchange(comm):
    """Top-k over packed buckets: every rank decodes every rank's message to the exact average."""
    cfg = build_compressor({"method": "topk", "density": 0.5, "fusion_bytes": 400})[1]
    layers = [Layer("a", (50,), 50, 0), Layer("b", (7, 3), 21, 1), Layer("c", (200,), 200, 2)]
    comp, _ = build_compressor(cfg)
    ex = GradientExchange(layers, comp, comm, LayerPolicy(cfg), fusion_bytes=cfg.fusion_bytes)
    assert len(ex.buckets) >= 2, "test needs several buckets"
    grads = [{l.name: torch.randn(l.numel, generator=torch.Generator().manual_seed(10 * r + l.index))
              for l in layers} for r in range(comm.size)]
    for l in reversed(layers):
        ex.submit(l.name, grads[comm.rank][l.name])
    out = ex.finish().averages
    for l in layers:
        expect = torch.zeros(l.numel)
        for g in grads:
            idx = torch.topk(g[l.name].abs(), (l.numel + 1) // 2).indices   # k = ceil(0.5 n)
            expect[idx] += g[l.name][idx]
        assert torch.allclose(out[l.name], expect / comm.size, atol=1e-6), l.name


def main():
    dist.init_process_group("gloo")
    comm = TorchDistCommunicator()
    collectives(comm)
    uneven_exchange(comm)
    print(f"rank {comm.rank}: OK torch.distributed communicator")
    close_process_group()


if __name__ == "__main__":
    main()
