"""The exchange with ``aggregation: sparse_reduce_scatter`` across real processes (horovodrun or
torchrun), after the communicator's alltoall and one bucket's reduce-scatter against their
references (tests/mp/alltoall.py, tests/mp/reduce_scatter.py), three checks:

1. density 1.0: every position is kept, so the average equals a dense allreduce of the same
   gradients (float tolerance), and nothing is left in any residual;
2. a 20-step run of a model (a diagonal quadratic per rank, gradients depend on the weights)
   equals a reference computed in this process from every rank's gradients: each rank's
   residual and top-k, the owners' sums and their ceil(k/N) largest, the return of what no
   owner kept to its sender, one SGD step on the applied average (int32 and Golomb-coded positions);
3. conservation with every codec (int8 codes and Golomb positions too): after many steps,
   N * (sum of the applied averages) + every rank's residual == every rank's gradients summed.

    horovodrun -np 3 python tests/mp/reduce_scatter_exchange.py horovod
    torchrun --nproc_per_node 3 tests/mp/reduce_scatter_exchange.py torch
"""
import sys

import torch
from reduce_scatter import check_bucket

from redsync_hvd.compressors.base import Layer
from redsync_hvd.core.layout import k_of
from redsync_hvd.engine import build_exchange
from redsync_hvd.exchange.regions import Regions
from redsync_hvd.launchers import close_process_group

SPEC = [("w", 600), ("v", 257), ("b", 3)]   # "b" has fewer positions than ranks at N = 4
BASE = {"policy": {"min_compress_numel": 0}, "fusion_bytes": 3000, "aggregation": "sparse_reduce_scatter"}
CODECS = {
    "topk": {"method": "topk"},
    "none": {"method": "redsync", "selection": "trimmed", "message": {"quantize": "none"},
             "dgc": {"momentum_correction": False}},
    "fp16": {"method": "redsync", "selection": "tbs", "message": {"quantize": "fp16"},
             "dgc": {"momentum_correction": False}},
    "sign_mean": {"method": "redsync", "selection": "tbs", "message": {"quantize": "sign_mean"},
                  "dgc": {"momentum_correction": False}},
    "radix": {"method": "redsync", "selection": "radix", "message": {"quantize": "sign_mean"},
              "dgc": {"momentum_correction": False}},
    # coded per owner (exchange/scatter_wire.py): Golomb places in the owner's region, int8 codes
    "none_golomb": {"method": "redsync", "selection": "trimmed", "dgc": {"momentum_correction": False},
                    "message": {"quantize": "none", "index_coding": "golomb"}},
    "int8_golomb": {"method": "redsync", "selection": "tbs", "dgc": {"momentum_correction": False},
                    "message": {"quantize": "int8", "index_coding": "golomb"}},
}


def exchange(comm, codec: str, density: float, aggregation: str = "sparse_reduce_scatter"):
    layers = [Layer(n, (m,), m, i) for i, (n, m) in enumerate(SPEC)]
    ex = build_exchange({**BASE, **CODECS[codec], "density": density, "aggregation": aggregation},
                        layers, comm).exchange
    assert len(ex.buckets) >= 2, "the test wants several buckets"
    assert all(b.kind == "scatter" for b in ex.buckets)
    return ex


def step(ex, grads: dict) -> dict:
    for name, _ in reversed(SPEC):
        ex.submit(name, grads[name])
    return {n: t.clone() for n, t in ex.finish().averages.items()}


def gradients(rank: int, t: int) -> dict:
    return {n: torch.randn(m, generator=torch.Generator().manual_seed(1000 * rank + 10 * t + i))
            for i, (n, m) in enumerate(SPEC)}


def dense_equals_allreduce(comm) -> None:
    ex, dense = exchange(comm, "topk", 1.0), build_exchange({"method": "none"}, [
        Layer(n, (m,), m, i) for i, (n, m) in enumerate(SPEC)], comm).exchange
    for t in range(3):
        g = gradients(comm.rank, t)
        got, expect = step(ex, g), step(dense, g)
        for name, _ in SPEC:
            assert torch.allclose(got[name], expect[name], atol=1e-6, rtol=1e-6), (t, name)
    assert all(float(r.abs().max()) == 0.0 for r in ex.residuals().values())


def curvature(rank: int) -> dict:
    return {n: 0.5 + torch.rand(m, generator=torch.Generator().manual_seed(77 + 7 * rank + i))
            for i, (n, m) in enumerate(SPEC)}


def quadratic_grad(weights: dict, rank: int, t: int) -> dict:
    """Rank ``rank``'s gradient at step t: a_r * w - b_r,t (its own diagonal quadratic)."""
    a, b = curvature(rank), gradients(rank, t)
    return {n: a[n] * weights[n] - b[n] for n in weights}


def reference_step(weights, residuals, size, t, density, lr):
    """One step of the algorithm for every rank at once, in dense tensors."""
    grads = [quadratic_grad(weights, r, t) for r in range(size)]
    for name, n in SPEC:
        k = k_of(n, density)
        sent, total = [], torch.zeros(n, dtype=torch.float64)
        for r in range(size):
            x = residuals[r][name] + grads[r][name]
            idx = torch.topk(x.abs(), k).indices
            mask = torch.zeros(n, dtype=torch.bool)
            mask[idx] = True
            sent.append(mask)
            total += torch.where(mask, x, 0.0).double()
            residuals[r][name] = torch.where(mask, 0.0, x)
            residuals[r][name + ".x"] = x
        owner = Regions.of(n, size).owners(torch.arange(n))
        applied, keep = torch.zeros(n, dtype=torch.bool), -(-k // size)
        anyone = torch.stack(sent).any(0)
        for o in range(size):
            cand = torch.nonzero(anyone & (owner == o)).reshape(-1)
            if cand.numel() > keep:
                cand = cand[torch.topk(total[cand].abs(), keep).indices]
            applied[cand] = True
        for r in range(size):   # what no owner kept goes back to its sender
            x = residuals[r].pop(name + ".x")
            residuals[r][name] = residuals[r][name] + torch.where(sent[r] & ~applied, x, 0.0)
        weights[name] = weights[name] - lr * torch.where(applied, total, 0.0).float() / size


def model_equals_reference(comm, codec: str, steps: int = 20, density: float = 0.05, lr: float = 0.1) -> None:
    ex = exchange(comm, codec, density)
    weights = {n: torch.ones(m) for n, m in SPEC}
    ref_w = {n: torch.ones(m) for n, m in SPEC}
    ref_res = [{n: torch.zeros(m) for n, m in SPEC} for _ in range(comm.size)]
    for t in range(steps):
        avg = step(ex, quadratic_grad(weights, comm.rank, t))
        weights = {n: weights[n] - lr * avg[n] for n in weights}
        reference_step(ref_w, ref_res, comm.size, t, density, lr)
    for name, _ in SPEC:
        assert torch.allclose(weights[name], ref_w[name], atol=1e-4, rtol=1e-4), \
            (codec, name, float((weights[name] - ref_w[name]).abs().max()))
        assert torch.allclose(ex.residuals()[name], ref_res[comm.rank][name], atol=1e-4, rtol=1e-4), name


def conserves(comm, codec: str, steps: int = 12, density: float = 0.02) -> None:
    ex = exchange(comm, codec, density)
    applied = {n: torch.zeros(m, dtype=torch.float64) for n, m in SPEC}
    for t in range(steps):
        avg = step(ex, gradients(comm.rank, t))
        for name in applied:
            applied[name] += comm.size * avg[name].double()
    mine = {n: r.double() for n, r in ex.residuals().items()}
    everyone = comm.allgather_object(mine, name=f"conserve.{codec}")
    for name, m in SPEC:
        inputs = sum(gradients(r, t)[name].double() for r in range(comm.size) for t in range(steps))
        held = applied[name] + sum(res[name] for res in everyone)
        assert torch.allclose(held, inputs, atol=1e-4), (codec, name, float((held - inputs).abs().max()))
        assert float(applied[name].abs().sum()) > 0, (codec, name, "nothing was applied")


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
    dense_equals_allreduce(comm)
    for codec in ("topk", "none", "none_golomb"):
        model_equals_reference(comm, codec)
    for codec in CODECS:
        conserves(comm, codec)
    print(f"rank {comm.rank}: OK reduce-scatter exchange {engine} of {comm.size}")
    if engine != "horovod":
        close_process_group()


if __name__ == "__main__":
    main()
