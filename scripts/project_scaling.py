#!/usr/bin/env python
"""Project speedup over dense fp32 ring allreduce with the alpha-beta cost model.

    python scripts/project_scaling.py                       # markdown table
    python scripts/project_scaling.py --plot scaling.png    # and a PNG
    python scripts/project_scaling.py --compute vgg16=0.5 --latency-us 50 --overlap

A PREDICTION, not a measurement: redsync_hvd/costmodel.py (algorithms.md section 6).
Methods: redsync = sign-mean (indices + one mean) at density 0.001; topk =
(int32, fp32) pairs at 0.001; iwp = shared indices + allreduce at 0.01;
decentralized = ring neighbour exchange of the 8-bit quantised full model.
Allgather-based methods and IWP send a layer compressed only when the per-layer
rule predicts a gain (fused dense cost); the others go through 64 MiB fusion buffers.

ASSUMED compute seconds per step (forward + backward, one V100, fp32), rough
figures from published single-GPU throughputs, not measured here:
  alexnet  0.04 s  (batch 128, ~3200 img/s)
  vgg16    0.28 s  (batch 64,  ~230 img/s)
  resnet50 0.17 s  (batch 64,  ~380 img/s)
  lstm_lm  0.05 s  (2x1500 PTB LM, batch 20 x 35 steps)
ASSUMED network: latency 25 us per message; selection/decompression costs from
costmodel.ComputeModel defaults (rough CPU numbers); no compute/comm overlap.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from redsync_hvd import costmodel as cm  # noqa: E402

DEFAULT_COMPUTE_S = {"alexnet": 0.04, "vgg16": 0.28, "resnet50": 0.17, "lstm_lm": 0.05}
METHODS = {  # label: (costmodel method, density)
    "redsync": ("sign_mean", 0.001),
    "topk": ("pairs", 0.001),
    "iwp": ("iwp", 0.01),
    "decentralized": ("decentralized", 1.0),
}
N_VALUES = [8, 16, 32, 64, 128, 256, 512, 1024]


def project(compute_s, bandwidths, latency_s, overlap, per_layer, models):
    rows = []
    shapes = {m: cm.PAPER_MODELS[m] for m in models}
    for label, (method, density) in METHODS.items():
        for r in cm.project_speedup(shapes, N_VALUES, bandwidths, method, density, compute_s,
                                    latency_s=latency_s, overlap=overlap, per_layer=per_layer):
            rows.append(dict(r, label=label))
    return rows


def markdown(rows, bandwidths, models):
    head = "| model | Gbit/s | method | " + " | ".join(f"N={n}" for n in N_VALUES) + " |"
    out = [head, "|" + "---|" * (3 + len(N_VALUES))]
    for model in models:
        for bw in bandwidths:
            for label in METHODS:
                sel = {r["N"]: r for r in rows
                       if r["model"] == model and r["bandwidth_gbit"] == bw and r["label"] == label}
                cells = " | ".join(f"{sel[n]['speedup']:.2f}" for n in N_VALUES)
                out.append(f"| {model} | {bw:g} | {label} | {cells} |")
    return "\n".join(out)


def plot(rows, bandwidths, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, model in zip(axes[0], models):
        for i, bw in enumerate(bandwidths):
            for j, label in enumerate(METHODS):
                pts = sorted((r["N"], r["speedup"]) for r in rows if r["model"] == model
                             and r["bandwidth_gbit"] == bw and r["label"] == label)
                ax.plot(*zip(*pts), styles[i % len(styles)], marker="o", ms=3,
                        color=f"C{j}", label=f"{label} {bw:g}G")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers N")
        ax.set_title(model)
    axes[0][0].set_ylabel("predicted speedup vs dense allreduce")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("alpha-beta model projection (assumed compute times; not measured)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidths", type=float, nargs="+", default=[10.0, 100.0], help="Gbit/s")
    ap.add_argument("--latency-us", type=float, default=25.0)
    ap.add_argument("--compute", nargs="*", default=[], metavar="MODEL=SECONDS",
                    help="override the assumed compute time per step")
    ap.add_argument("--models", nargs="+", default=list(cm.PAPER_MODELS), choices=list(cm.PAPER_MODELS))
    ap.add_argument("--overlap", action="store_true", help="step = max(compute, comm)")
    ap.add_argument("--no-per-layer", action="store_true", help="compress every layer")
    ap.add_argument("--plot", metavar="OUT.png")
    a = ap.parse_args(argv)
    compute_s = dict(DEFAULT_COMPUTE_S)
    for kv in a.compute:
        k, v = kv.split("=")
        compute_s[k] = float(v)
    rows = project(compute_s, a.bandwidths, a.latency_us * 1e-6, a.overlap, not a.no_per_layer, a.models)
    print(f"Projected speedup vs dense fp32 ring allreduce (alpha = {a.latency_us:g} us; "
          f"compute s/step: {', '.join(f'{m} {compute_s[m]:g}' for m in a.models)}; "
          f"{'overlap' if a.overlap else 'no overlap'}). Model prediction, assumed inputs.\n")
    print(markdown(rows, a.bandwidths, a.models))
    if a.plot:
        plot(rows, a.bandwidths, a.models, a.plot)
        print(f"\nwrote {a.plot}")


if __name__ == "__main__":
    main()
