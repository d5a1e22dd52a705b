#!/usr/bin/env python
"""Benchmark redsync_hvd selection methods against torch.topk(x.abs(), k).

    python scripts/bench_selection.py                          # 1M..64M, CPU
    python scripts/bench_selection.py --sizes 16M --repeats 9 --out sel.md
    python scripts/bench_selection.py --device cuda --out sel.json
    python scripts/bench_selection.py --device cuda --methods "" --exact-k torch,triton,triton-graph

For every size x distribution (Gaussian, Student-t with 3 dof) x density, both the
baseline and each method run in this process on the same tensor; the table gives the
median and best time over --repeats (after one warm-up), speedup = median topk_ms /
median method_ms, and the number selected over k (exact/trimmed: 1.0; tbs/sampled: 1..2).
``--exact-k`` adds the device-resident exact-k select (core/select/'s radix strategy) (one layer
as a bucket, no host wait): "torch" (its reference in plain torch ops), "triton" (the
kernels), "triton-graph" (the kernels replayed from a CUDA graph: no launch overhead).
Each such row also checks that its k-th key equals the smallest of torch.topk's values.
The exact-k rows run first; every row is guarded (a failure loses that row only) and the
results are written after each size and density.
Timings on a loaded machine are noise: the load average is recorded with the results,
and --wait-idle S waits for an idle CPU before each case.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from redsync_hvd.core.segments import Segments
from redsync_hvd.core.select import Contract, native_available, select, select_topk
from redsync_hvd.experiments import machine, tables
from redsync_hvd.experiments.stats import graphed, timed_ms
from redsync_hvd.experiments.tables import write_result

EXACT_K = ("torch", "triton", "triton-graph")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def make(dist: str, n: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    z = torch.randn(n, generator=g)
    if dist == "t3":  # z / sqrt(chi2_3 / 3): heavy-tailed like embedding/LSTM gradients
        chi2 = sum(torch.randn(n, generator=g) ** 2 for _ in range(3))
        z = z / torch.sqrt(chi2 / 3)
    return z.to(device)


def cpu_idle(seconds: float = 2.0) -> float:
    """Fraction of CPU time idle over a short window (Linux /proc/stat; 1.0 elsewhere)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(a) for a in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
        return (i1 - i0) / max(1, t1 - t0)
    except OSError:
        return 1.0


def wait_idle(limit_s: float) -> None:
    """On a shared machine, wait (up to limit_s) for two idle windows in a row: an
    OpenMP pass whose thread is preempted costs a whole scheduler slice."""
    end, ok = time.time() + limit_s, 0
    while ok < 2 and time.time() < end:
        ok = ok + 1 if cpu_idle() > 0.85 else 0


def exact_k_row(x, k, backend, base, args):
    """Time the radix select on x as a one-layer bucket; check its k-th key against topk."""
    seg = Segments([x.numel()], [k], align=16 if x.numel() % 16 == 0 else 1)   # 16: 128-bit loads
    be = "torch" if backend == "torch" else "triton"
    fn = lambda: select(seg, x, Contract("radix", backend=be))  # noqa: E731
    try:
        kth = fn().kth.view(torch.float32)[0]
        ok = bool(kth == torch.topk(x.abs(), k).values.min())
        ms, best = timed_ms(graphed(fn) if backend == "triton-graph" else fn, args.repeats, args.device)
    except Exception as e:  # report and go on: the other rows still count
        print("  exact-k %s failed: %s: %s" % (backend, type(e).__name__, e), file=sys.stderr)
        return dict(method="exact-k %s (FAILED)" % backend, ms=float("nan"), best_ms=float("nan"),
                    speedup=float("nan"), count_over_k=float("nan"))
    name = "exact-k %s" % backend + ("" if ok else " (WRONG k-th key)")
    return dict(method=name, ms=ms, best_ms=best, speedup=base / ms, count_over_k=1.0)


def method_row(x, k, m, base, args) -> dict:
    """Time select_topk's method m on x; a failure loses this row only."""
    opts = {} if m == "exact" else {"backend": args.backend}
    try:
        ms, best = timed_ms(lambda: select_topk(x, k, m, **opts), args.repeats, args.device)
        cnt = select_topk(x, k, m, **opts).numel()
    except Exception as e:  # report and go on: the other rows still count
        print("  %s failed: %s: %s" % (m, type(e).__name__, e), file=sys.stderr)
        return dict(method="%s (FAILED)" % m, ms=float("nan"), best_ms=float("nan"), speedup=float("nan"),
                    count_over_k=float("nan"))
    print("  %6.1fM d=%-6g %-10s %9.2f ms (best %8.2f)  x%6.1f  count/k=%.3f"
          % (x.numel() / 2 ** 20, k / x.numel(), m, ms, best, base / ms, cnt / k), file=sys.stderr)
    return dict(method=m, ms=ms, best_ms=best, speedup=base / ms, count_over_k=cnt / k)


def run(args, info) -> dict:
    rows = []
    for n in [parse_size(s) for s in args.sizes.split(",")]:
        for dist in args.dists.split(","):
            x = make(dist, n, args.device)
            for density in [float(d) for d in args.densities.split(",")]:
                k = max(1, int(n * density))
                if args.wait_idle:
                    wait_idle(args.wait_idle)
                base, base_best = timed_ms(lambda: torch.topk(x.abs(), k), args.repeats, args.device)
                rows.append(dict(n=n, dist=dist, density=density, k=k, method="torch.topk",
                                 ms=base, best_ms=base_best, speedup=1.0, count_over_k=1.0))
                for b in [b for b in args.exact_k.split(",") if b]:     # the exact-k rows first
                    r = dict(n=n, dist=dist, density=density, k=k, **exact_k_row(x, k, b, base, args))
                    rows.append(r)
                    print("  %6.1fM %-5s d=%-6g %-10s %9.2f ms (best %8.2f)  x%6.1f"
                          % (n / 2 ** 20, dist, density, r["method"], r["ms"], r["best_ms"], r["speedup"]),
                          file=sys.stderr)
                for m in [m for m in args.methods.split(",") if m]:
                    rows.append(dict(n=n, dist=dist, density=density, k=k, **method_row(x, k, m, base, args)))
                save(rows, info, args)   # what is done survives a time limit
            x = None   # the next size allocates anew: free this one first
        save(rows, info, args)   # what is done survives a time limit
    return rows


def markdown(rows, info) -> str:
    out = ["Machine: %s, %s cores, %d torch threads, torch %s, device %s%s, native kernel: %s."
           % (info["cpu"], info["cores"], info["threads"], info["torch"], info["device"],
              " (%s)" % info["gpu"] if "gpu" in info else "", info["native"]),
           "Load average before/after: %s / %s." % (info.get("load_before"), info.get("load_after")), ""]
    head = ["elements", "dist", "density", "k", "method", "median ms", "best ms", "speedup vs topk (median)",
            "selected / k"]
    cells = [["%gM" % (r["n"] / 2 ** 20) if r["n"] >= 2 ** 20 else "%gK" % (r["n"] / 2 ** 10), r["dist"],
              "%g" % r["density"], r["k"], r["method"], "%.2f" % r["ms"], "%.2f" % r["best_ms"],
              "%.1fx" % r["speedup"], "%.3f" % r["count_over_k"]] for r in rows]
    return "\n".join(out) + "\n" + tables.markdown(head, cells, "rlrrlrrrr").rstrip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,4M,16M,64M", help="comma list, suffix K/M/G = 2**10/20/30")
    p.add_argument("--dists", default="gauss,t3")
    p.add_argument("--densities", default="0.001,0.01")
    p.add_argument("--methods", default="exact,trimmed,tbs,sampled")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backend", choices=["auto", "native", "cuda", "torch"], default="auto",
                   help="compute path of --methods (cuda: the CuPy kernels)")
    p.add_argument("--exact-k", default=None, metavar="BACKENDS",
                   help="comma list of %s (default: all three on CUDA, torch on the CPU; '' for none); "
                        "triton on the CPU needs TRITON_INTERPRET=1" % ", ".join(EXACT_K))
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    p.add_argument("--wait-idle", type=float, default=0, metavar="S",
                   help="shared machines: before each case wait up to S s for an idle CPU")
    p.add_argument("--out", default="", help="write results: *.json, or markdown otherwise")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if args.exact_k is None:
        args.exact_k = ",".join(EXACT_K) if args.device == "cuda" else "torch"
    bad = [b for b in args.exact_k.split(",") if b and b not in EXACT_K]
    if bad or ("triton-graph" in args.exact_k and args.device != "cuda"):
        p.error("--exact-k: choose from %s (triton-graph needs --device cuda), got %r"
                % (", ".join(EXACT_K), args.exact_k))
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine.describe(args.device, ("triton", "cupy"), threads=torch.get_num_threads(),
                            native=native_available(), backend=args.backend)
    info["load_before"] = "%.2f" % os.getloadavg()[0]
    rows = run(args, info)
    info["load_after"] = "%.2f" % os.getloadavg()[0]
    print(markdown(rows, info))
    save(rows, info, args)


def save(rows, info, args) -> None:
    if args.out:
        write_result(args.out, info, rows, markdown(rows, info))


if __name__ == "__main__":
    main()
