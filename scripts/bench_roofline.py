#!/usr/bin/env python
"""Compensation + selection per step against this machine's stream bandwidth, in one run.

    python scripts/bench_roofline.py                              # CPU: 16M and 64M fp32, density 0.001
    python scripts/bench_roofline.py --device cuda --out roofline.json   # CUDA tensors, Triton's exact-k

For each selection mode (exact-k/radix, TBS with threshold reuse, trimmed top-k, DGC's sampled
threshold) and size: the median time of one step of compensation + selection + residual update,
the bytes per element the mode must move (its floor: redsync_hvd/experiments/roofline.py derives
each), the bandwidth that floor reaches in that time, and its share of a triad ``a = b + s*c``
over buffers of the same size measured just before (torch, the same threads).
"""
from __future__ import annotations

import argparse

import torch

from redsync_hvd.experiments import machine, roofline, tables
from redsync_hvd.experiments.tables import write_result

SIZES = {"1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26}


def markdown(rows: list, info: dict) -> str:
    head = ["mode", "n", "floor B/elem", "ms best", "ms median", "ms mean", "GB/s (best)", "triad GB/s",
            "share (best)", "share (median)"]
    cells = [[r["mode"], "%dM" % (r["n"] >> 20), "%.2f" % r["floor_B_per_elem"], "%.2f" % r["best_ms"],
              "%.2f" % r["ms"], "%.2f" % r["mean_ms"], "%.2f" % r["GB_s"], "%.2f" % r["triad_GB_s"],
              "%.0f%%" % (100 * r["share"]), "%.0f%%" % (100 * r["share_median"])] for r in rows]
    return ("Device: %s; %s threads; torch %s; density %g; %d steps after %d warm-up.\n\n"
            % (info["device"], info["threads"], info["torch"], info["density"], info["steps"], info["warmup"])
            + tables.markdown(head, cells, "lrrrrrrrrr").rstrip())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sizes", default="16M,64M", help="comma list of %s" % ", ".join(SIZES))
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--modes", default="", help="comma list of words a mode's name contains (default: all)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--exact-steps", type=int, default=0,
                   help="exact-k's steps (no warm-up) where they differ; default: 2 under --backend torch on a CPU")
    p.add_argument("--backend", default="auto", help="exact-k: auto (CUDA: Triton, else native), triton, native, torch")
    p.add_argument("--out", default="", help="write the results: *.json, or markdown otherwise")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if any(s not in SIZES for s in args.sizes.split(",")):
        p.error("--sizes: choose from %s" % ", ".join(SIZES))
    info = machine.describe(args.device, ("triton",), density=args.density, steps=args.steps, warmup=args.warmup,
                            threads=torch.get_num_threads())
    info["device"] = info.get("gpu") or "%s (%s cores)" % (info["cpu"], info["cores"])
    only, rows = [m for m in args.modes.split(",") if m], []
    exact_steps = args.exact_steps or (2 if (args.device, args.backend) == ("cpu", "torch") else None)
    for size in args.sizes.split(","):
        got = roofline.run_size(SIZES[size], args.density, args.device, args.backend, args.steps, args.warmup, only,
                                exact_steps=exact_steps)
        for r in got:
            print("  %-24s %s  best %8.2f ms  median %8.2f ms  %6.2f GB/s  (%3.0f%% of triad %.2f GB/s)" % (
                r["mode"], size, r["best_ms"], r["ms"], r["GB_s"], 100 * r["share"], r["triad_GB_s"]), flush=True)
        rows += got
        if args.out:   # what is measured so far, after every size
            write_result(args.out, info, rows, markdown(rows, info))
    print(markdown(rows, info))


if __name__ == "__main__":
    main()
