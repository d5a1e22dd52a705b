#!/usr/bin/env python
"""Where a compressed step's time goes: device time and kernel launches per step (torch.profiler).

    python scripts/profile_exchange.py --out profile.json         # CUDA: vgg_fc4096, resnet20
    python scripts/profile_exchange.py --device cpu --models resnet20 --batches 16 --size 64K

For each model of scripts/bench_overhead.py and each batch size: forward + backward time, the
whole exchange's wall time (``LocalCommunicator(2)``, as bench_overhead.py runs it) and its
share of compute, then three exchange steps under ``torch.profiler``: device time per step
(the sum of the kernels' self device time), kernel launches per step (cudaLaunchKernel,
cuLaunchKernel, cuLaunchKernelEx, cudaLaunchKernelExC), the kernels that take the most device
time and the host ops that take the most host time. The same for the exact-k select of one
layer of ``--size`` elements (k = n/1000) against ``torch.topk``. Methods: the exact-k exchange
(``redsync_mc_exact_k``) and, where the configuration has it, the same replayed from a CUDA graph
(``redsync_mc_exact_k_graph``, see bench_overhead.py); each method and model is guarded, so one
failure loses only its rows. On the CPU the profiler sees no device: launches are then counted
with core/launches.py (Triton kernels and aten ops that would launch one), the kernels in
Triton's interpreter.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")       # before triton is imported
import bench_overhead as bench  # noqa: E402  (this script's folder: the models and methods of bench_overhead.py)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from redsync_hvd.core.launches import Launches  # noqa: E402
from redsync_hvd.core.segments import Segments  # noqa: E402
from redsync_hvd.core.select import Contract, select  # noqa: E402
from redsync_hvd.experiments.stats import sync, timed_ms  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
METHODS = ("redsync_mc_exact_k", "redsync_mc_exact_k_graph")


def measure(fn, steps, cuda):
    """(device ms per step, launches per step, top device rows, top host rows) of ``steps`` calls."""
    sync("cuda" if cuda else "cpu")
    if not cuda:                      # no device to profile: count what would launch
        with Launches() as counted:
            for _ in range(steps):
                fn()
        return None, counted.total / steps, [], []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync("cuda")
    events = prof.key_averages()
    dev = sorted(events, key=lambda e: -e.self_device_time_total)
    host = sorted(events, key=lambda e: -e.self_cpu_time_total)
    return (sum(e.self_device_time_total for e in events) / steps / 1e3,
            sum(e.count for e in events if e.key in LAUNCHES) / steps,
            [(e.key[:90], e.self_device_time_total / steps / 1e3, e.count / steps) for e in dev[:12]],
            [(e.key[:90], e.self_cpu_time_total / steps / 1e3, e.count / steps) for e in host[:12]])


def report(label, result):
    dev_ms, launches, dev, host = result
    print("== %s: device time/step %s ms, kernel launches/step %.0f" % (
        label, "-" if dev_ms is None else "%.3f" % dev_ms, launches))
    for key, ms, count in dev:
        print("   dev %8.3f ms  n/step %6.1f  %s" % (ms, count, key))
    if host:
        print("   -- top host self time")
    for key, ms, count in host:
        print("   cpu %8.3f ms  n/step %6.1f  %s" % (ms, count, key))


def model_rows(mname, args, cuda):
    """Rows of one model: per batch size and method, compute, exchange, share, device time, launches."""
    spec = bench.MODELS[mname]
    torch.manual_seed(0)
    model = bench.build_model(spec["model"], 10, (3, 32, 32), **spec["options"]).to(args.device)
    lossf, rows = torch.nn.CrossEntropyLoss(), []
    for batch in [int(b) for b in args.batches.split(",")]:
        x = torch.randn(batch, 3, 32, 32, device=args.device)
        y = torch.randint(0, 10, (batch,), device=args.device)

        def compute():
            model.zero_grad(set_to_none=False)
            lossf(model(x), y).backward()
        for method in METHODS:
            try:
                variant = bench.Variant(method, bench.METHODS[method], model, 2)
                compute()
                for _ in range(args.warmup):
                    variant.exchange()
                exchange_ms = timed_ms(variant.exchange, args.repeats, args.device, warmup=0)[0]
                compute_ms = timed_ms(compute, args.repeats, args.device, warmup=0)[0]
                result = measure(variant.exchange, 3, cuda)
            except Exception as e:   # noqa: BLE001 - report it and go on: the other rows still count
                print("  %s batch %d %s cannot run: %s: %s" % (mname, batch, method, type(e).__name__, e),
                      file=sys.stderr)
                continue
            print("#### %s batch %d %s: compute(fwd+bwd) %.2f ms, exchange %.2f ms, share %.2f%%"
                  % (mname, batch, method, compute_ms, exchange_ms, 100 * exchange_ms / compute_ms))
            report("%s batch %d %s exchange" % (mname, batch, method), result)
            rows.append(dict(model=mname, batch=batch, method=method, compute_ms=compute_ms, exchange_ms=exchange_ms,
                             share=exchange_ms / compute_ms, device_ms=result[0], launches=result[1],
                             launch_source="torch.profiler" if cuda else "core/launches.py (interpreter)"))
            save(rows, args)
    return rows


def select_rows(args, cuda):
    """The exact-k select of one layer against torch.topk: device time and launches per call."""
    n = bench_size(args.size)
    x = torch.randn(n, device=args.device)
    seg = Segments([n], [max(1, n // 1000)], align=16)
    rows = []
    for name, fn in (("exact-k select (triton)", lambda: select(seg, x, Contract("radix", backend="triton"))),
                     ("torch.topk", lambda: torch.topk(x.abs(), max(1, n // 1000)))):
        try:
            fn()
            result = measure(fn, 5, cuda)
        except Exception as e:   # noqa: BLE001
            print("  %s cannot run: %s: %s" % (name, type(e).__name__, e), file=sys.stderr)
            continue
        report("%s, %d elements" % (name, n), result)
        rows.append(dict(what=name, n=n, device_ms=result[0], launches=result[1]))
    return rows


def bench_size(s: str) -> int:
    s = s.strip().upper()
    return int(float(s[:-1]) * {"K": 1 << 10, "M": 1 << 20}[s[-1]]) if s[-1] in "KM" else int(s)


def save(rows, args, select=None):
    if args.out:
        old = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                old = json.load(f)
        old["exchange"] = rows if rows is not None else old.get("exchange", [])
        if select is not None:
            old["select"] = select
        old["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        with open(args.out, "w") as f:
            json.dump(old, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--models", default=",".join(bench.MODELS))
    p.add_argument("--batches", default="16,128")
    p.add_argument("--size", default="16M", help="elements of the one-layer select (K/M suffix)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", default="", help="also write every row here (JSON)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    if args.out and os.path.exists(args.out):
        os.remove(args.out)
    rows = []
    for mname in args.models.split(","):
        rows += model_rows(mname, args, cuda)
        save(rows, args)
    save(rows, args, select=select_rows(args, cuda))


if __name__ == "__main__":
    main()
