#!/usr/bin/env python
"""Peak memory per rank of sharded training with and without RedSync, against DDP, on a model
whose weights dominate its memory (an MLP of 14.7M parameters: 1024 -> 4 x 2048 -> 10).

    python scripts/fsdp_memory.py [--np 2] [--steps 4] [--only KEY ...] [--out FILE.md]

Each row is its own launch (``torchrun --standalone --nproc_per_node N``, Gloo on the CPU), so
no row inherits another's peak. Each rank measures its resident set (``/proc/self/status``:
VmRSS) once its process group is up and before the model exists (the baseline: Python, torch,
Gloo), then trains ``--steps`` steps of SGD (momentum 0.9, batch 32 of random inputs) and reads
its peak resident set (VmHWM). The table gives, per row, the largest peak over ranks minus that
rank's baseline: what the model, its gradients, the optimizer, FSDP's gathered layers, the
activations and the compression state took at their peak. Beside it, the state a rank keeps
between steps, counted from the tensors: weights, optimizer state, and the compression state
(residuals and velocities, both halves of their double buffers).

Rows: FSDP2 dense; FSDP2 + RedSync (density 0.01, fp16 values) with fp32 and with bf16
residuals, without and with DGC's momentum correction (a velocity beside the residual); DDP
dense; DDP + RedSync with the same messages (selection: radix, as under FSDP).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from redsync_hvd.experiments.jobs import command, job_env, launch
from redsync_hvd.experiments.tables import markdown

SHAPE = {"in": 1024, "hidden": [2048, 2048, 2048, 2048], "out": 10}
REDSYNC = {"method": "redsync", "density": 0.01, "selection": {"method": "radix"}, "message": {"quantize": "fp16"},
           "dgc": {"momentum_correction": False}, "policy": {"min_compress_numel": 4096}}
DGC = {"dgc": {"momentum_correction": True}}
ROWS = {   # key: (label, engine, compression)
    "fsdp-dense": ("FSDP2 dense", "fsdp", {"method": "none"}),
    "fsdp-redsync": ("FSDP2 + RedSync, fp32 residuals", "fsdp", REDSYNC),
    "fsdp-redsync-bf16": ("FSDP2 + RedSync, bf16 residuals", "fsdp", {**REDSYNC, "residual_dtype": "bf16"}),
    "fsdp-redsync-dgc": ("FSDP2 + RedSync + momentum correction, fp32", "fsdp", {**REDSYNC, **DGC}),
    "fsdp-redsync-dgc-bf16": ("FSDP2 + RedSync + momentum correction, bf16", "fsdp",
                              {**REDSYNC, **DGC, "residual_dtype": "bf16"}),
    "ddp-dense": ("DDP dense", "ddp", {"method": "none"}),
    "ddp-redsync": ("DDP + RedSync, fp32 residuals", "ddp", REDSYNC),
    "ddp-redsync-dgc": ("DDP + RedSync + momentum correction, fp32", "ddp", {**REDSYNC, **DGC}),
}


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def compression_bytes(state) -> int:
    """Both halves of every double buffer the compression keeps between steps."""
    if hasattr(state, "groups"):   # FSDP: redsync_hvd.exchange.sharded.ShardedGroup
        pairs = [p for g in state.groups for p in (g.residual, g.velocity, g.dense_velocity) if p is not None]
        return tensor_bytes([t for p in pairs for t in (p.cur, p.spare)] + list(state._scratch.values()))
    memory = getattr(getattr(state, "exchange", None), "memory", None)
    held = [getattr(memory, k, {}) for k in ("residual", "_spare", "velocity", "_spare_u")]
    flats = [t for pair in getattr(memory, "_flats", {}).values() for t in (pair.cur, pair.spare)]
    return tensor_bytes([t for d in held for t in d.values()] + flats)


def worker(key: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from redsync_hvd.models import build_model
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _, engine, compression = ROWS[key]
    base = status_kb("VmRSS")
    torch.manual_seed(0)
    model = build_model("mlp", SHAPE["out"], (SHAPE["in"],), hidden=SHAPE["hidden"])
    if engine == "fsdp":
        from redsync_hvd.torch import fsdp as rfsdp
        rfsdp.shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        state = rfsdp.register(model, compression, optimizer=opt)
        net = model
    else:
        from torch.nn.parallel import DistributedDataParallel

        from redsync_hvd.torch import ddp as rddp
        net = DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        state = rddp.register(net, compression, optimizer=opt)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(32, SHAPE["in"], generator=gen), torch.randint(0, SHAPE["out"], (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    optim = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    mine = {"baseline_kb": base, "peak_kb": status_kb("VmHWM"), "weights": tensor_bytes(model.parameters()),
            "optimizer": tensor_bytes(optim), "compression": compression_bytes(state)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every))
    from redsync_hvd.launchers import close_process_group
    close_process_group()


def measure(key: str, n: int, steps: int) -> list:
    """One row's launch: every rank's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "memory.json", Path(tmp) / "job.log"
        # glibc raises its mmap threshold after each large free (up to 32 MB), and then serves
        # large tensors from heaps it keeps: the resident set would remember every transient
        # buffer. A fixed threshold (setting it turns the adjustment off) maps each tensor of 128
        # KB or more and unmaps it when freed, so the resident set follows what is alive.
        env = job_env(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
        cmd = command("torchrun", n, [__file__, "--worker", key, "--steps", steps, "--json", out])
        status = launch(cmd, log, timeout=1800, env=env)
        if status != "ok":
            raise SystemExit(f"{key}: the job {status}:\n{log.read_text()[-3000:]}")
        return json.loads(out.read_text())


def table(results: dict, n: int) -> str:
    mb = 1 << 20
    head = [f"per rank, {n} ranks", "peak above baseline, MB", "kept between steps, MB: weights", "optimizer",
            "compression", "total"]
    rows = []
    for key, ranks in results.items():
        peak = max(r["peak_kb"] - r["baseline_kb"] for r in ranks) / 1024
        w, o, c = (max(r[k] for r in ranks) / mb for k in ("weights", "optimizer", "compression"))
        rows.append([ROWS[key][0], f"{peak:,.0f}", f"{w:,.0f}", f"{o:,.0f}", f"{c:,.0f}", f"{w + o + c:,.0f}"])
    return markdown(head, rows, "lrrrrr")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--out", help="also write the table to this markdown file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.steps, a.json)
        return
    results = {}
    for key in a.only:
        results[key] = measure(key, a.np, a.steps)
        print(f"{key}: peak {max(r['peak_kb'] - r['baseline_kb'] for r in results[key]) / 1024:,.0f} MB above "
              "baseline", flush=True)
    params = sum(n_in * n_out + n_out for n_in, n_out in zip([SHAPE["in"], *SHAPE["hidden"]],
                                                             [*SHAPE["hidden"], SHAPE["out"]]))
    text = (f"Peak memory per rank, MLP {SHAPE['in']} -> {' -> '.join(map(str, SHAPE['hidden']))} -> {SHAPE['out']} "
            f"({params / 1e6:.1f}M parameters, {params * 4 / (1 << 20):,.0f} MB in fp32), {a.np} ranks, SGD momentum "
            f"0.9, batch 32, {a.steps} steps (`python scripts/fsdp_memory.py --np {a.np} --steps {a.steps}`)\n\n"
            + table(results, a.np))
    print("\n" + text)
    if a.out:
        Path(a.out).write_text(text)
        Path(a.out).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
