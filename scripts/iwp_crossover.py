"""Where IWP's allreduce beats RedSync's allgather as N grows (alpha-beta model).

    python scripts/iwp_crossover.py [--numel 25000000] [--bandwidth-gbit 10] [--latency-us 25]

Prints predicted communication time per step of one layer for dense allreduce,
top-k pairs and RedSync sign-mean over ring allgather, and IWP (broadcast of the
leader's indices + allreduce of values), and the N from which IWP is faster.
"""
from __future__ import annotations

import argparse

from redsync_hvd.policy.costmodel import Network, predict_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--bandwidth-gbit", type=float, default=10.0)
    ap.add_argument("--latency-us", type=float, default=25.0)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    args = ap.parse_args()
    net = Network.from_config(latency_s=args.latency_us * 1e-6, bandwidth_gbit=args.bandwidth_gbit)
    print(f"layer of {args.numel:,} elements, {args.bandwidth_gbit:g} Gbit/s, {args.latency_us:g} us latency; "
          "communication only (ms)\n")
    for d in args.densities:
        print(f"density {d}:\n\n| N | dense allreduce | topk pairs (allgather) | redsync sign_mean (allgather) "
              "| IWP (bcast + allreduce) |\n|---|---|---|---|---|")
        crossover = None
        for n in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            c = {m: predict_layer(args.numel, d, n, net, m) for m in ("pairs", "sign_mean", "iwp")}
            print(f"| {n} | {c['pairs'].dense_s * 1e3:.2f} | {c['pairs'].comm_s * 1e3:.2f} | "
                  f"{c['sign_mean'].comm_s * 1e3:.2f} | {c['iwp'].comm_s * 1e3:.2f} |")
            if crossover is None and c["iwp"].comm_s < c["sign_mean"].comm_s:
                crossover = n
        print(f"\nIWP's communication beats RedSync sign-mean allgather from N = {crossover}\n")


if __name__ == "__main__":
    main()
