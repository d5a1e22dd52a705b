"""DCD/ECD replicas of neighbour models stay BIT-IDENTICAL to the true models, step after step.

Every rank starts from a different random model (so the initial fp32 exchange
matters), takes random gradients, and after each step allgathers every rank's
model (DCD) or its own estimate y_i (ECD) through mpi4py, then compares its
replicas with torch.equal. Prints "OK replicas <method> <quantizer>" per config.

Horovod is not initialised here: this is mpi4py's transport (``NeighborExchange``),
for MPI jobs without Horovod. Horovod's transport, the default, is covered by
decentral_quadratic.py, which checks that both deliver the same bytes.
"""
import torch

torch.set_num_threads(1)   # tiny tensors; 2 shared cores
from mpi4py import MPI  # noqa: E402

from redsync_hvd.decentralized import build_algorithm  # noqa: E402

CONFIGS = [
    ("dcd", dict(quantizer="minmax", bits=8)),
    ("dcd", dict(quantizer="minmax", bits=4)),
    ("dcd", dict(quantizer="minmax", bits=2)),
    ("dcd", dict(quantizer="grid", bits=4, step=0.05)),
    ("dcd", dict(quantizer="topk", density=0.3)),
    ("dcd", dict(quantizer="topk", density=0.3, unbiased=False)),
    ("ecd", dict(quantizer="grid", bits=8, step=0.05)),
    ("ecd", dict(quantizer="minmax", bits=4)),
]
SIZES = (37, 100)
STEPS = 15


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    assert size == 4, f"expected the 4-rank MPI world horovodrun -np 4 starts, got {size}"
    for method, kw in CONFIGS:
        algo = build_algorithm(method, seed=3, **kw)
        assert algo.ex.size == size and len(algo.ex.neighbors) == (1 if size == 2 else 2)
        gen = torch.Generator().manual_seed(100 + rank)
        params = [torch.randn(n, generator=gen) for n in SIZES]
        for step in range(STEPS):
            grads = [torch.randn(n, generator=gen) for n in SIZES]
            algo.step(params, grads, lr=0.1)
            # what each rank's neighbours must hold for it: its model (DCD) or its estimate y_i (ECD)
            truth = params if method == "dcd" else algo.replicas[rank]
            everyone = comm.allgather([t.clone() for t in truth])
            for j in algo.ex.neighbors:
                for k, (mine, true) in enumerate(zip(algo.replicas[j], everyone[j])):
                    assert torch.equal(mine, true), (
                        f"{method} {kw}: rank {rank}'s replica of rank {j} (tensor {k}) differs at step {step}: "
                        f"max diff {(mine - true).abs().max().item():g}")
            if method == "ecd":   # the estimate tracks the model up to compression noise
                assert all(torch.isfinite(y).all() for y in algo.replicas[rank])
        assert algo.t == STEPS
        print(f"rank {rank}: OK replicas {method} {algo.q!r}", flush=True)
    print(f"rank {rank}: OK all replicas", flush=True)


if __name__ == "__main__":
    main()
