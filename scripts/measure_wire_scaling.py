#!/usr/bin/env python
"""Bytes per worker and step as the number of workers grows: dense allreduce, RedSync's
allgather and its sparse reduce-scatter (``aggregation: sparse_reduce_scatter``), measured;
with ``--engine fsdp``, FSDP2's dense reduce-scatter against RedSync and top-k through it.

    python scripts/measure_wire_scaling.py [--np 2 3 4 8] [--steps 6] [--engine horovod|fsdp] [--out FILE.md]

For every N it launches ``horovodrun --gloo -np N`` on this host (TCP over loopback); each
worker trains ``vgg_fc4096`` (docs/benchmarks.md) on synthetic inputs with every method in turn,
through ``DistributedOptimizer`` with a communicator that counts what each collective moves
for this rank:

* allgather: sent = its own tensor, received = every other rank's (any algorithm must
  deliver those);
* alltoall: sent = its rows for the other ranks, received = the other ranks' rows for it;
* allreduce: 2(N-1)/N of the tensor each way (a ring, the bandwidth-optimal algorithm; what
  Horovod's and Gloo's implementations move may be more);
* reduce-scatter (``--engine fsdp``: ``torchrun --standalone --nproc_per_node N``, every layer of
  the model in ``fully_shard``, ``redsync_hvd.torch.fsdp.register`` with the counting
  communicator): (N-1)/N of the tensor each way, the pieces of the other ranks' shards.

The first ``--warmup`` steps (the density warm-up is off) are not counted; the table gives
the mean of the other steps over ranks, and each method's received bytes at every N against
N = 2. The machine only runs the processes: the counts do not depend on it.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from redsync_hvd.experiments.jobs import command, job_env, launch
from redsync_hvd.experiments.tables import markdown

REDSYNC = {"method": "redsync", "density": 0.001, "selection": {"method": "tbs", "threshold_reuse": 5},
           "message": {"quantize": "sign_mean"}, "dgc": {"momentum_correction": False}}
METHODS = {
    "dense": {"method": "none"},
    "redsync allgather": {**REDSYNC, "aggregation": "allgather"},
    "redsync sparse_reduce_scatter": {**REDSYNC, "aggregation": "sparse_reduce_scatter"},
    "topk allgather": {"method": "topk", "density": 0.001, "policy": {"min_compress_numel": 4096}},
    "topk sparse_reduce_scatter": {"method": "topk", "density": 0.001, "policy": {"min_compress_numel": 4096},
                                   "aggregation": "sparse_reduce_scatter"},
}


# engine: fsdp (exchange/sharded.py): exactly k per shard piece, so the selection is radix
FSDP_METHODS = {
    "dense (FSDP2's reduce-scatter)": {"method": "none"},
    "redsync": {**REDSYNC, "selection": {"method": "radix"}},
    "topk": {"method": "topk", "density": 0.001, "policy": {"min_compress_numel": 4096}},
}


class Counting:
    """A communicator that counts the bytes each collective moves for this rank."""

    def __init__(self, inner):
        self.inner, self.sent, self.received = inner, 0.0, 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @property
    def rank(self):
        return self.inner.rank

    @property
    def size(self):
        return self.inner.size

    def _ring(self, tensor):
        share = 2 * (self.size - 1) / self.size * tensor.numel() * tensor.element_size()
        self.sent += share
        self.received += share

    def allreduce_async(self, tensor, name, average=True):
        self._ring(tensor)
        return self.inner.allreduce_async(tensor, name, average)

    def allreduce_async_(self, tensor, name, average=True):
        self._ring(tensor)
        return self.inner.allreduce_async_(tensor, name, average)

    def reduce_scatter_async(self, tensor, name, average=True, out=None):
        share = (self.size - 1) / self.size * tensor.numel() * tensor.element_size()
        self.sent += share
        self.received += share
        return self.inner.reduce_scatter_async(tensor, name, average, out)

    def allgather_async(self, tensor, name, sizes=None):
        return ("allgather", tensor.numel() * tensor.element_size(), self.inner.allgather_async(tensor, name, sizes))

    def alltoall_async(self, tensor, splits, name):
        row = tensor[:1].numel() * tensor.element_size() if tensor.shape[0] else 0
        self.sent += (sum(splits) - splits[self.rank]) * row
        return ("alltoall", row, self.inner.alltoall_async(tensor, splits, name))

    def wait(self, handle):
        if not (isinstance(handle, tuple) and len(handle) == 3 and handle[0] in ("allgather", "alltoall")):
            return self.inner.wait(handle)
        kind, size, inner = handle
        got = self.inner.wait(inner)
        if kind == "allgather":
            self.sent += size
            self.received += got.numel() * got.element_size() - size
            return got
        tensor, splits = got
        self.received += (sum(splits) - splits[self.rank]) * size
        return got


def train_counting(model, opt, comm: Counting, rank: int, steps: int, warmup: int):
    """Train ``warmup + steps`` steps on this rank's synthetic batches; (sent, received) bytes per
    counted step, as a float64 tensor to average over ranks."""
    import torch
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(warmup + steps):
        if step == warmup:
            comm.sent = comm.received = 0.0
        x, y = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return torch.tensor([comm.sent / steps, comm.received / steps], dtype=torch.float64)


def worker(steps: int, warmup: int, out: str) -> None:
    import horovod.torch as hvd
    import torch

    import redsync_hvd.torch as rhvd
    from redsync_hvd.comm import HorovodCommunicator
    from redsync_hvd.models import build_model
    hvd.init()
    torch.set_num_threads(1)
    result = {}
    for label, compression in METHODS.items():
        torch.manual_seed(0)
        model = build_model("vgg", 10, (3, 32, 32), fc_width=4096, width=0.25)
        comm = Counting(HorovodCommunicator(hvd))
        opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters(), compression=compression,
                                        communicator=comm)
        mine = train_counting(model, opt, comm, hvd.rank(), steps, warmup)
        result[label] = hvd.allreduce(mine, op=hvd.Average, name=f"measure.{label}").tolist()
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(result))


def worker_fsdp(steps: int, warmup: int, out: str) -> None:
    """One rank under torchrun: each FSDP method in turn on the same model and inputs."""
    import torch
    import torch.distributed as dist

    from redsync_hvd.comm.torch_dist import TorchDistCommunicator
    from redsync_hvd.models import build_model
    from redsync_hvd.torch import fsdp as rfsdp
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = {}
    for label, compression in FSDP_METHODS.items():
        torch.manual_seed(0)
        model = build_model("vgg", 10, (3, 32, 32), fc_width=4096, width=0.25)
        rfsdp.shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        comm = Counting(TorchDistCommunicator())
        rfsdp.register(model, compression, optimizer=opt, communicator=comm)
        mine = train_counting(model, opt, comm, dist.get_rank(), steps, warmup)
        dist.all_reduce(mine)
        result[label] = (mine / dist.get_world_size()).tolist()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    from redsync_hvd.launchers import close_process_group
    close_process_group()


def measure(n: int, steps: int, warmup: int, engine: str = "horovod") -> dict:
    """Every method's bytes at ``n`` workers: one ``horovodrun --gloo -np n`` job of this script
    (``torchrun --nproc_per_node n`` for engine: fsdp)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "bytes.json", Path(tmp) / "job.log"
        cmd = command("torchrun" if engine == "fsdp" else "horovodrun-gloo", n,
                      [__file__, "--worker", "--engine", engine, "--steps", steps, "--warmup", warmup, "--json", out])
        status = launch(cmd, log, timeout=1800, env=job_env(OMP_NUM_THREADS="1"))
        if status != "ok":
            raise SystemExit(f"N={n}: the job {status}:\n{log.read_text()[-3000:]}")
        return json.loads(out.read_text())


def table(results: dict) -> str:
    ns = sorted(results)
    head = ["method", *(f"N={n} received (sent) KB" for n in ns), f"received N={ns[-1]} / N={ns[0]}"]
    rows = [[label, *(f"{results[n][label][1] / 1e3:,.1f} ({results[n][label][0] / 1e3:,.1f})" for n in ns),
             f"{results[ns[-1]][label][1] / results[ns[0]][label][1]:.2f}x"] for label in results[ns[0]]]
    return markdown(head, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, nargs="+", default=[2, 3, 4, 8])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--engine", choices=("horovod", "fsdp"), default="horovod",
                    help="horovod: allreduce, allgather, sparse reduce-scatter; fsdp: FSDP2's reduce-scatter")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        (worker_fsdp if a.engine == "fsdp" else worker)(a.steps, a.warmup, a.json)
        return
    results = {}
    for n in a.np:
        results[n] = measure(n, a.steps, a.warmup, a.engine)
        print(f"N={n}: " + ", ".join(f"{k} {v[1] / 1e3:.1f} KB received" for k, v in results[n].items()), flush=True)
    engine = " --engine fsdp" if a.engine == "fsdp" else ""
    text = (f"Bytes per worker and step, vgg_fc4096, mean of {a.steps} steps after {a.warmup} and of the ranks "
            f"(`python scripts/measure_wire_scaling.py --np {' '.join(map(str, a.np))} --steps {a.steps}{engine}`)\n\n"
            + table(results))
    print("\n" + text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
