#!/usr/bin/env python
"""Throughput and size of the Golomb-Rice position coder (redsync_hvd.core.golomb).

For each layer size n and density p, draws k = p*n distinct positions uniformly
at random, encodes them with b = optimal_b(p) and decodes them back (checking
the round trip), and prints a markdown table:

* encode / decode throughput in positions/s and in MB/s of the *original*
  index stream (k int64 indices = 8k bytes; halve the MB/s for int32),
* bits per position measured on the byte stream (8 * payload bytes / k, final
  padding included) next to the formula b + 1/(1 - (1-p)^(2^b)),
* the size ratio against int32 indices (32 bits per position).

Times are the best of --repeats runs (wall clock, single process).

    python scripts/bench_golomb.py                     # n = 1M, 16M, 64M; p = 0.01, 0.001
    python scripts/bench_golomb.py --sizes 1e6 --densities 0.01 --repeats 3
    REDSYNC_NO_NATIVE=1 python scripts/bench_golomb.py    # numpy's coder, the reference
"""
import argparse
import os
import time

import numpy as np
import torch

from redsync_hvd.core import golomb
from redsync_hvd.core.golomb import (
    decode_positions,
    encode_positions,
    expected_bits,
    optimal_b,
)
from redsync_hvd.experiments.machine import cpu_name


def best_time(fn, repeats):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def human(n):
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return str(n)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 16e6, 64e6], help="layer sizes n")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001], help="densities p")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per cell (best is reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    print(
        f"# Golomb-Rice position coding: {cpu_name()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"numpy {np.__version__}, best of {args.repeats}, coder: "
        f"{'native (core/_native)' if golomb._coder() is not None else 'numpy (REDSYNC_NO_NATIVE=1 or not built)'}\n"
    )
    print(
        "| n | p | positions | b | encode ms | encode Mpos/s | encode MB/s | decode ms | decode Mpos/s "
        "| decode MB/s | bits/pos measured | bits/pos formula | vs int32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in (int(s) for s in args.sizes):
        for p in args.densities:
            k = max(1, int(round(p * n)))
            pos = torch.from_numpy(np.sort(rng.choice(n, size=k, replace=False)))
            t_enc, (payload, b) = best_time(lambda: encode_positions(pos, n), args.repeats)
            assert b == optimal_b(p)
            t_dec, out = best_time(lambda: decode_positions(payload, k, b), args.repeats)
            if not torch.equal(out, pos):
                raise SystemExit(f"round trip FAILED for n={n} p={p}")
            index_mb = 8 * k / 1e6  # the original int64 index stream
            bits = 8 * payload.numel() / k
            print(
                f"| {human(n)} | {p:g} | {k} | {b} "
                f"| {1e3 * t_enc:.2f} | {k / t_enc / 1e6:.1f} | {index_mb / t_enc:.0f} "
                f"| {1e3 * t_dec:.2f} | {k / t_dec / 1e6:.1f} | {index_mb / t_dec:.0f} "
                f"| {bits:.3f} | {expected_bits(p, b):.3f} | {32 / bits:.2f}x |"
            )


if __name__ == "__main__":
    main()
