#!/usr/bin/env python
"""DDP step time: plain DDP against redsync_hvd's hooks, and torch's PowerSGD hook against ours, on the same work.

    torchrun --standalone --nproc_per_node 2 scripts/bench_ddp_hook.py            # Gloo on CPU
    torchrun --standalone --nproc_per_node 2 scripts/bench_ddp_hook.py --models cnn --rounds 15 --out ddp_hook.md
    torchrun --standalone --nproc_per_node 2 scripts/bench_ddp_hook.py --variants compressed --models cnn
    torchrun --standalone --nproc_per_node 2 scripts/bench_ddp_hook.py --variants cost_model --models cnn

For each model, DDP copies (same weights, same synthetic batches, same SGD) train in rounds
of ``--steps`` steps, one copy after the other in an order that rotates every round, so load
drifting on a shared machine hits all alike: plain DDP, our hook as ``none`` (DDP's arithmetic
exactly, bytes counted), and our hook with ``check_finite: true`` (one summing pass more). A
round gives each its mean step time (forward, backward with the reduction, optimizer step)
after ``--warmup`` steps, and a ratio to plain DDP's time in the same round (1.00: no cost),
in wall time and in CPU time (this process, all its threads: steadier than wall time when
other jobs share the cores, since waiting costs none). Rank 0 prints the medians, the
median ratios with their interquartile ranges over rounds, and the machine, as a Markdown
table; ``--out FILE`` also writes it there, with the command that made it. The target is a
ratio within 1.05 for ``hook none`` (wall clock, on a machine with nothing else running).
``--variants cost_model``: RedSync's hook under ``policy.mode: cost_model`` on a link where dense wins (the probes
decide) should send dense and cost no more than 1/0.97 of plain DDP; the table says how many layers it compressed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from redsync_hvd.experiments import machine
from redsync_hvd.models import build_model
from redsync_hvd.torch import ddp as rddp

MODELS = {
    # the digits peer workload (1x8x8 images, batch 32)
    "cnn": dict(model="cnn", options={}, input_shape=(1, 8, 8), classes=10, batch=32),
    # communication-bound: 4096-wide fully connected layers (the end-to-end benchmark's model)
    "vgg_fc4096": dict(model="vgg", options={"fc_width": 4096, "width": 0.25}, input_shape=(3, 32, 32),
                       classes=10, batch=16),
}


# what DDP's reduction runs: its own (None), torch's PowerSGD hook ("torch powerSGD_hook"), or
# our hook with these settings; --variants picks a set, each timed against plain DDP
REDSYNC = {"method": "redsync", "density": 0.01, "selection": {"method": "tbs", "threshold_reuse": 5},
           "message": {"quantize": "sign_mean"}, "dgc": {"momentum_correction": False},
           "policy": {"min_compress_numel": 1024}}   # configs/digits/redsync.yaml after its warm-up
VARIANT_SETS = {
    "hook": {
        "plain DDP": None,
        "hook none": {"method": "none"},                                               # the default
        "hook none, check_finite: true": {"method": "none", "check_finite": True},     # a summing pass more
    },
    "compressed": {
        "plain DDP": None,
        "torch powerSGD_hook": "torch_powersgd",       # rank 2, start_powerSGD_iter 2
        "hook powersgd": {"method": "powersgd", "rank": 2, "start_iter": 2},   # configs/digits/powersgd.yaml
        "hook redsync": REDSYNC,
        "hook redsync, two rounds": {**REDSYNC, "policy": {**REDSYNC["policy"], "dense_in_gather_bytes": 0}},
    },
    "cost_model": {
        "plain DDP": None,
        "hook redsync cost_model": {**REDSYNC, "policy": {"mode": "cost_model", "min_compress_numel": 1024}},
    },
}
# the ratios each set is judged by: (variant, against)
JUDGED = {"hook": [("hook none", "plain DDP")],
          "compressed": [("hook powersgd", "torch powerSGD_hook"), ("hook redsync", "plain DDP"),
                         ("hook redsync, two rounds", "plain DDP")],
          "cost_model": [("hook redsync cost_model", "plain DDP")]}
COMPRESSED: dict = {}   # {(model, variant): "k/n layers compressed"} of our hooks, for the table


def variant(spec: dict, device, compression, key=None):
    """A DDP model, its optimizer and a step function; ``compression``: our hook's config, or None."""
    torch.manual_seed(0)
    model = build_model(spec["model"], spec["classes"], spec["input_shape"], **spec["options"]).to(device)
    ddp = DDP(model)
    if compression == "torch_powersgd":
        state = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, torch_psgd.powerSGD_hook)
    elif compression is not None:
        decided = rddp.register(ddp, compression).layer_decisions()
        if decided:   # the fast path (method none) decides nothing
            COMPRESSED[key] = f"{sum(d['compressed'] for d in decided)}/{len(decided)} layers compressed at start"
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(spec["batch"], *spec["input_shape"], device=device)
    y = torch.randint(0, spec["classes"], (spec["batch"],), device=device)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return step


def timed(step, steps: int, warmup: int, device) -> tuple:
    """(wall, CPU) seconds per step after ``warmup`` steps; ranks start together."""
    for _ in range(warmup):
        step()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def summary(times: list, base: list) -> tuple:
    """(median ms, quartiles of the paired ratios to ``base``'s times in the same rounds)."""
    ratios = sorted(t / p for t, p in zip(times, base))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(times) * 1e3, quartiles


def bench(name: str, args, device) -> dict:
    """{variant: [(wall, CPU) seconds per step, one per round]}; the order rotates every round."""
    spec = MODELS[name]
    steps = {label: variant(spec, device, compression, (name, label))
             for label, compression in VARIANT_SETS[args.variants].items()}
    labels = list(steps)
    times: dict = {label: [] for label in labels}
    for r in range(args.rounds):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            times[label].append(timed(steps[label], args.steps, args.warmup, device))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--variants", default="hook", choices=list(VARIANT_SETS),
                        help="hook: our hook as none against plain DDP; compressed: torch's PowerSGD hook "
                             "against ours, and our RedSync hook against plain DDP; cost_model: our RedSync "
                             "hook under policy.mode cost_model against plain DDP")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="also write the table to this file (Markdown)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and os.environ.get("REDSYNC_BENCH_CPU") != "1"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows = [(name, bench(name, args, device)) for name in args.models]
    if dist.get_rank() == 0:
        text = "\n".join(table(rows, args, device)) + "\n"
        print(text, end="")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            command = f"torchrun --standalone --nproc_per_node {dist.get_world_size()} " + " ".join(sys.argv)
            with open(args.out, "w") as f:
                f.write(f"`{command}`\n\n{text}")
    from redsync_hvd.launchers import close_process_group
    close_process_group()


def table(rows: list, args, device) -> list:
    """Every variant's median step time and ratio to plain DDP, then the ratios the set is judged by."""
    lines = [f"machine: {machine.line(machine.describe(device.type))}; {dist.get_backend()} on {device.type}, "
             f"{dist.get_world_size()} ranks, {args.rounds} rounds x {args.steps} steps (after {args.warmup})",
             "",
             "| model | clock | variant | ms/step | / plain DDP (median, IQR over rounds) |",
             "|-------|-------|---------|---------|----------------------------------------|"]
    judged = []
    for name, times in rows:
        for clock, clock_name in ((0, "wall"), (1, "CPU")):
            column = {label: [t[clock] for t in ts] for label, ts in times.items()}
            for label, ts in column.items():
                ms, (q1, q2, q3) = summary(ts, column["plain DDP"])
                note = f" ({COMPRESSED[name, label]})" if (name, label) in COMPRESSED else ""
                lines.append(f"| {name} | {clock_name} | {label}{note} | {ms:.2f} | {q2:.3f} ({q1:.3f}-{q3:.3f}) |")
            for label, against in JUDGED[args.variants]:
                _, (q1, q2, q3) = summary(column[label], column[against])
                judged.append(f"| {name} | {clock_name} | {label} / {against} | {q2:.3f} ({q1:.3f}-{q3:.3f}) |")
    return lines + ["", "| model | clock | ratio | median (IQR over rounds) |", "|---|---|---|---|"] + judged


if __name__ == "__main__":
    main()
