"""A quadratic toy problem on a ring: f_i(x) = 0.5 ||x - b_i||^2, optimum = mean of b_i.

Runs every named config (argv[1], comma-separated; argv[2] steps) in one launch, over
argv[3]'s transport (``horovod``, the default, or ``mpi4py``: then Horovod is never
initialised, so mpi4py is the only MPI caller), and prints, from rank 0, one line
``RESULT {json}`` per config with relative errors (divided by ||bbar||), all measured with evaluation allreduces:

- ``err_avg``: ||mean_i x_i - bbar|| (the average model vs the optimum);
- ``err_fp``: mean_i ||x_i - x*_i|| where x* is the fixed point of uncompressed
  D-PSGD at this constant lr: x* = lr ((1 + lr) I - W)^-1 B. Constant-step
  decentralized SGD on heterogeneous b_i keeps each x_i an O(lr) distance from
  bbar; that part is the same for every method, so this isolates what
  compression adds;
- ``err_workers``: mean_i ||x_i - bbar||; ``consensus``: mean_i ||x_i - xbar||;
- ``hist``: err_avg and err_fp at each quarter of the run; bytes per step.
"""
import json
import sys

import torch

from redsync_hvd.decentralized import build_algorithm, ring

torch.set_num_threads(1)   # tiny tensors; 2 shared cores

CONFIGS = {
    "dpsgd": ("dpsgd", {}),
    "dcd8": ("dcd", dict(quantizer="minmax", bits=8)),
    "dcd4": ("dcd", dict(quantizer="minmax", bits=4)),
    "ecd8": ("ecd", dict(quantizer="grid", bits=8, step=0.05)),
    "ecd4": ("ecd", dict(quantizer="grid", bits=4, step=0.5)),
    "naive4": ("naive", dict(quantizer="minmax", bits=4)),
    "naive8": ("naive", dict(quantizer="minmax", bits=8)),
}
D, SPLIT, LR, CENTRE, SPREAD = 1000, (600, 400), 0.5, 0.5, 0.5


def problem(n):
    gen = torch.Generator().manual_seed(0)
    c = CENTRE * torch.randn(D, generator=gen, dtype=torch.float64)
    B = c + SPREAD * torch.randn(n, D, generator=gen, dtype=torch.float64)
    W = ring(n).W
    xstar = torch.linalg.solve((1 + LR) * torch.eye(n, dtype=torch.float64) - W, LR * B)
    return B, B.mean(0), xstar


def run(name, steps, rank, n, comm=None):
    method, kw = CONFIGS[name]
    B, bbar, xstar = problem(n)
    b = B[rank].float()
    algo = build_algorithm(method, seed=1, comm=comm, **kw)
    x = torch.zeros(D)
    params = list(torch.split(x, SPLIT))          # two contiguous views: a two-tensor model
    scale = float(bbar.norm())

    def errors():
        avg = torch.cat(algo.average_model(params)).double()
        mine = torch.tensor([float((x.double() - xstar[rank]).norm()), float((x.double() - bbar).norm())])
        fp, wk = (algo.ex.allreduce_sum(mine) / n / scale).tolist()
        return float((avg - bbar).norm()) / scale, fp, wk

    hist = []
    for t in range(steps):
        g = x - b
        algo.step(params, list(torch.split(g, SPLIT)), LR)
        if (t + 1) % (steps // 4) == 0:
            ea, ef, _ = errors()
            hist.append([t + 1, ea, ef])
    err_avg, err_fp, err_workers = errors()
    st = algo.stats()
    return dict(name=name, method=method, kw=kw, n=n, steps=steps, err_avg=err_avg, err_fp=err_fp,
                err_workers=err_workers, consensus=algo.consensus_distance(params) / scale, hist=hist,
                message_bytes=st["message_bytes"], bytes_per_step=st["bytes_sent"] / steps,
                payload_per_step=st["payload_bytes_sent"] / steps, degree=st["degree"],
                setup_bytes=st.get("setup_bytes", 0), clipped=st.get("clipped"),
                ratio=st["compression_ratio"])


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CONFIGS)
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    transport = sys.argv[3] if len(sys.argv) > 3 else "horovod"
    if transport == "mpi4py":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, n = comm.Get_rank(), comm.Get_size()
    else:
        import horovod.torch as hvd
        hvd.init()
        comm, rank, n = None, hvd.rank(), hvd.size()
    for name in names:
        out = dict(run(name, steps, rank, n, comm), transport=transport)
        if rank == 0:
            print("RESULT " + json.dumps(out), flush=True)
    print(f"rank {rank}: OK quadratic", flush=True)


if __name__ == "__main__":
    main()
