#!/usr/bin/env python
"""The exact-k bucket stages against a model's compute, on one device, with no network.

    python scripts/bench_bucket_select.py --device cuda --out stages.json
    python scripts/bench_bucket_select.py --models resnet20 --steps 3      # CPU smoke run

For each model of scripts/bench_overhead.py (at its batch size) this times a training
step's forward + backward + SGD update, and the exact-k stages of core/select/'s radix strategy
over the model's compressed layers as one bucket (those of at least --min-numel elements,
k = ceil(density * n) each, as the compressors count it): compensate with DGC momentum, select with
sign_mean and the fused residual update and velocity masking, and the decode of --world
ranks' messages into the averaged gradient. Backends: "torch" (the reference ops),
"triton" (the kernels; on the CPU only under TRITON_INTERPRET=1), "triton-graph" (the
same launches replayed from one CUDA graph). ``stages / compute`` is what these stages
would add to a step before any byte moves; the exchange's own share, with packing and its
bookkeeping, comes from bench_overhead.py once it runs them. Host waits are counted in
one step: on CUDA every synchronising torch call (torch.cuda.set_sync_debug_mode).
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings

import torch

from redsync_hvd.core.segments import Segments
from redsync_hvd.core.select import Contract, HistogramRequest, compensate, decode_add, select
from redsync_hvd.experiments import machine, tables
from redsync_hvd.experiments.stats import graphed, sync, timed_ms
from redsync_hvd.experiments.tables import write_result
from redsync_hvd.models import build_model

MODELS = {   # as in scripts/bench_overhead.py
    "vgg_fc4096": dict(model="vgg", options={"fc_width": 4096, "width": 0.25}, batch=16),
    "resnet20": dict(model="resnet20", options={}, batch=16),
}
BACKENDS = ("torch", "triton", "triton-graph")


class Stages:
    """One step of the bucket's exact-k stages on static buffers (so a CUDA graph can replay it)."""

    def __init__(self, sizes, density, world, device, backend):
        self.seg = Segments(sizes, [max(1, math.ceil(density * n)) for n in sizes], align=16)
        n, self.world, self.backend = self.seg.n, world, backend
        gen = torch.Generator().manual_seed(0)
        self.r, self.u, self.g = (torch.randn(n, generator=gen).to(device) for _ in range(3))
        self.x, self.u_new, self.avg = (torch.zeros(n, device=device) for _ in range(3))

    def __call__(self):
        seg, c = self.seg, Contract("radix", backend=self.backend)
        hist = compensate(self.r, self.g, self.x, velocity=self.u, velocity_out=self.u_new, momentum=0.9,
                          first=HistogramRequest(seg, "pos", c))
        sel = select(seg, self.x, c, sign="pos", mean=True, first=hist, update=True, velocity=self.u_new)
        # every rank's message is this one: the decode does the work of world messages
        decode_add(seg, self.avg, sel.positions.expand(self.world, -1), means=sel.means.expand(self.world, -1),
                   alpha=1.0 / self.world, contract=c)


def host_waits(fn, device) -> int:
    """Synchronising torch calls in one call of fn (CUDA); 0 on the CPU, where nothing waits."""
    if device != "cuda":
        return 0
    fn()
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sync(device)
    return sum("synchroniz" in str(w.message) for w in caught)


def bench_model(name, args):
    spec = MODELS[name]
    torch.manual_seed(0)
    model = build_model(spec["model"], 10, (3, 32, 32), **spec["options"]).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(spec["batch"], 3, 32, 32, device=args.device)
    y = torch.randint(0, 10, (spec["batch"],), device=args.device)

    def step():
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    compute = timed_ms(step, args.steps, args.device, args.warmup)[0]
    sizes = [p.numel() for p in model.parameters() if p.numel() >= args.min_numel]
    row = dict(model=name, compute_ms=compute, layers=len(sizes), elements=sum(sizes))
    for backend in args.backends.split(","):
        stages = Stages(sizes, args.density, args.world, args.device, "torch" if backend == "torch" else "triton")
        try:
            waits = host_waits(stages, args.device)
            ms = timed_ms(graphed(stages) if backend == "triton-graph" else stages, args.steps, args.device,
                          args.warmup)[0]
        except Exception as e:  # report it and go on: the other rows still count
            print("  %s %s failed: %s: %s" % (name, backend, type(e).__name__, e), file=sys.stderr)
            ms, waits = float("nan"), None
        row[backend] = dict(stages_ms=ms, share=ms / compute, host_waits=waits)
        print("  %-10s %-12s compute %8.2f ms  stages %8.3f ms  (%5.1f%% of compute), host waits %s"
              % (name, backend, compute, ms, 100 * ms / compute, waits), file=sys.stderr)
    return row


def markdown(rows, info):
    head = ["model", "compressed layers", "elements", "compute ms", "backend", "stages ms", "stages / compute",
            "host waits"]
    cells = [[r["model"], r["layers"], "%.2fM" % (r["elements"] / 1e6), "%.2f" % r["compute_ms"], b,
              "%.3f" % r[b]["stages_ms"], "%.1f%%" % (100 * r[b]["share"]), r[b]["host_waits"]]
             for r in rows for b in BACKENDS if b in r]
    return ("Device: %s; torch %s; triton %s; density %g; world %d.\n\n" % (
        info["device"], info["torch"], info["triton"], info["density"], info["world"])
        + tables.markdown(head, cells, "lrrrlrrr").rstrip())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backends", default=None, help="comma list of %s (default: all on CUDA, torch on the CPU)"
                   % ", ".join(BACKENDS))
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--world", type=int, default=2, help="ranks whose messages each worker decodes")
    p.add_argument("--min-numel", type=int, default=4096, help="smaller layers go dense (the compressors' default)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="", help="write the results: *.json, or markdown otherwise")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    args.backends = args.backends or (",".join(BACKENDS) if args.device == "cuda" else "torch")
    if any(b not in BACKENDS for b in args.backends.split(",")) or \
            ("triton-graph" in args.backends and args.device != "cuda"):
        p.error("--backends: choose from %s (triton-graph needs --device cuda)" % ", ".join(BACKENDS))
    info = machine.describe(args.device, ("triton",), density=args.density, world=args.world)
    info["device"] = info.get("gpu", "CPU")
    rows = [bench_model(m, args) for m in args.models.split(",")]
    md = markdown(rows, info)
    print(md)
    if args.out:
        write_result(args.out, info, rows, md)


if __name__ == "__main__":
    main()
