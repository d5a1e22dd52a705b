#!/usr/bin/env python
"""Project speedup over dense fp32 ring allreduce with the alpha-beta cost model.

    python scripts/project_scaling.py                       # markdown table
    python scripts/project_scaling.py --plot scaling.png    # and a PNG
    python scripts/project_scaling.py --compute vgg16=0.5 --latency-us 50 --overlap
    python scripts/project_scaling.py --compute-from runs/bench/<run>/results.csv

A PREDICTION, not a measurement: redsync_hvd/policy/costmodel.py (the alpha-beta model of collectives).
Methods: redsync = sign-mean (indices + one mean) at density 0.001; topk =
(int32, fp32) pairs at 0.001; both by allgather, and as redsync_rs, topk_rs by the sparse
reduce-scatter (aggregation: sparse_reduce_scatter: an alltoall of each worker's entries to
their owners, an allgather of the owners' k/N re-selection); iwp = shared indices +
allreduce at 0.01; decentralized = ring neighbour exchange of the 8-bit quantised full model.
A second table names, per model and bandwidth, the N from which each reduce-scatter path is
predicted faster than its allgather path.
Allgather-based methods and IWP send a layer compressed only when the per-layer
rule predicts a gain (fused dense cost); the others go through 64 MiB fusion buffers.
Allgather-based methods travel in the exchange's 16 MiB buckets (one collective each).
Per (model, bandwidth) the table ends with a "best" row: the fastest method at each N
("dense" where none beats it).

Models: the paper-scale layer shapes (costmodel.PAPER_MODELS) and the two reference
models of the wall-clock bench, built by redsync_hvd.models (vgg_fc4096: VGG-11 at 1/4
width with the 4096-wide FC head, 17.9M parameters; resnet20: 0.27M).

ASSUMED compute seconds per step (forward + backward, one V100, fp32), rough
figures from published single-GPU throughputs, not measured here:
  alexnet  0.04 s  (batch 128, ~3200 img/s)
  vgg16    0.28 s  (batch 64,  ~230 img/s)
  resnet50 0.17 s  (batch 64,  ~380 img/s)
  lstm_lm  0.05 s  (2x1500 PTB LM, batch 20 x 35 steps)
MEASURED for the reference models: one process's compute-only step on this project's
2-core CPU (batch 16), ``compute_alone_s`` of the cost-model sweep; ``--compute-from``
reads them from any bench results.csv.
ASSUMED network: latency 25 us per message; selection/decompression costs from
costmodel.ComputeModel defaults (rough CPU numbers); no compute/comm overlap.
"""
from __future__ import annotations

import argparse
import os
import sys

from redsync_hvd.policy import costmodel as cm

DEFAULT_COMPUTE_S = {"alexnet": 0.04, "vgg16": 0.28, "resnet50": 0.17, "lstm_lm": 0.05,
                     # compute_alone_s of docs/results/cpu-2cores-2026-11-26/costmodel-20261126-110529
                     "vgg_fc4096": 0.116, "resnet20": 0.114}
REFERENCE_MODELS = {  # bench name: (model, options), as in configs/bench/costmodel.yaml
    "vgg_fc4096": ("vgg", {"fc_width": 4096, "width": 0.25}),
    "resnet20": ("resnet20", {}),
}
METHODS = {  # label: (costmodel method, density, aggregation of the compressed buckets)
    "redsync": ("sign_mean", 0.001, "allgather"),
    "redsync_rs": ("sign_mean", 0.001, "sparse_reduce_scatter"),
    "topk": ("pairs", 0.001, "allgather"),
    "topk_rs": ("pairs", 0.001, "sparse_reduce_scatter"),
    "iwp": ("iwp", 0.01, "allgather"),
    "decentralized": ("decentralized", 1.0, "allgather"),
}
#: (reduce-scatter label, allgather label): the crossing table compares these pairs
PATHS = {"redsync_rs": "redsync", "topk_rs": "topk"}
N_VALUES = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def layer_shapes(models) -> dict:
    """{model: [numel per parameter tensor]}: paper shapes, or a reference model's own."""
    out = {}
    for m in models:
        if m in cm.PAPER_MODELS:
            out[m] = cm.PAPER_MODELS[m]
            continue
        from redsync_hvd.models import build_model  # torch on demand: paper shapes need none
        name, options = REFERENCE_MODELS[m]
        out[m] = [p.numel() for p in build_model(name, 10, (3, 32, 32), **options).parameters()]
    return out


def compute_from_csv(path) -> dict:
    """{model: compute_alone_s} from a bench results.csv (one process, no communication)."""
    import csv
    if not os.path.isfile(path):
        raise SystemExit(f"error: --compute-from {path}: no such file; pass the results.csv of a "
                         "scripts/bench_end_to_end.py run (its run folder is printed on its last line)")
    out = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("compute_alone_s") and float(row["compute_alone_s"]) > 0:
                out[row["model"]] = float(row["compute_alone_s"])
    if not out:
        raise SystemExit(f"error: {path} has no compute_alone_s values; pass a bench run's results.csv")
    return out


def project(compute_s, bandwidths, latency_s, overlap, per_layer, models):
    rows = []
    shapes = layer_shapes(models)
    for label, (method, density, aggregation) in METHODS.items():
        for r in cm.project_speedup(shapes, N_VALUES, bandwidths, method, density, compute_s,
                                    latency_s=latency_s, overlap=overlap, per_layer=per_layer,
                                    aggregation=aggregation):
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
            out.append(f"| {model} | {bw:g} | **best** | "
                       + " | ".join(best(rows, model, bw, n) for n in N_VALUES) + " |")
    return "\n".join(out)


def faster_from(rows, model, bw, label: str, than: str):
    """The smallest N of ``N_VALUES`` at which ``label`` is predicted faster than ``than`` and
    not slower at any larger N (where both leave every layer dense they tie), or None."""
    step = {(r["label"], r["N"]): r["method_s"] for r in rows if r["model"] == model and r["bandwidth_gbit"] == bw}
    faster = [step[(label, n)] < step[(than, n)] * (1 - 1e-9) for n in N_VALUES]
    not_slower = [step[(label, n)] <= step[(than, n)] * (1 + 1e-9) for n in N_VALUES]
    for i in range(len(N_VALUES)):
        if faster[i] and all(not_slower[i:]):
            return N_VALUES[i]
    return None


def crossings(rows, bandwidths, models) -> str:
    """Per model and bandwidth, from which N each reduce-scatter path beats its allgather path."""
    out = ["| model | Gbit/s | " + " | ".join(f"{rs} faster than {ag} from" for rs, ag in PATHS.items()) + " |",
           "|" + "---|" * (2 + len(PATHS))]
    for model in models:
        for bw in bandwidths:
            cells = []
            for rs, ag in PATHS.items():
                n = faster_from(rows, model, bw, rs, ag)
                cells.append("never" if n is None else f"N = {n}")
            out.append(f"| {model} | {bw:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def best(rows, model, bw, N) -> str:
    """The fastest method at this point, or dense when none is predicted faster."""
    cands = [r for r in rows if r["model"] == model and r["bandwidth_gbit"] == bw and r["N"] == N]
    top = max(cands, key=lambda r: r["speedup"])
    return top["label"] if top["speedup"] > 1.0 + 1e-9 else "dense"


def plot(rows, bandwidths, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cols = min(3, len(models))
    rows_n = -(-len(models) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.6 * rows_n), squeeze=False)
    for ax in axes.flat[len(models):]:
        ax.set_visible(False)
    styles = ["-", "--", ":", "-."]
    for ax, model in zip(axes.flat, models):
        for i, bw in enumerate(bandwidths):
            for j, label in enumerate(METHODS):
                pts = sorted((r["N"], r["speedup"]) for r in rows if r["model"] == model
                             and r["bandwidth_gbit"] == bw and r["label"] == label)
                rs = label in PATHS   # the reduce-scatter rows: crosses, drawn over their allgather twins
                ax.plot(*zip(*pts), styles[i % len(styles)], marker="x" if rs else "o", ms=4 if rs else 3,
                        lw=0.8 if rs else 1.2, color=f"C{j}", label=f"{label} {bw:g}G")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
        ax.tick_params(axis="y", which="minor", labelsize=6)
        ax.set_xlabel("workers N")
        ax.set_title(model)
    for row in axes:
        row[0].set_ylabel("predicted speedup vs dense allreduce")
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle("alpha-beta model projection (compute: assumed for paper shapes, measured on CPU for "
                 "the reference models; a prediction, not a measurement)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bandwidths", type=float, nargs="+", default=[1.0, 10.0, 100.0], help="Gbit/s")
    ap.add_argument("--latency-us", type=float, default=25.0)
    ap.add_argument("--compute", nargs="*", default=[], metavar="MODEL=SECONDS",
                    help="override the assumed compute time per step")
    ap.add_argument("--compute-from", metavar="RESULTS.csv",
                    help="take the reference models' compute from a bench run (compute_alone_s)")
    every = list(cm.PAPER_MODELS) + list(REFERENCE_MODELS)
    ap.add_argument("--models", nargs="+", default=every, choices=every)
    ap.add_argument("--overlap", action="store_true", help="step = max(compute, comm)")
    ap.add_argument("--no-per-layer", action="store_true", help="compress every layer")
    ap.add_argument("--plot", metavar="OUT.png")
    a = ap.parse_args(argv)
    compute_s = dict(DEFAULT_COMPUTE_S)
    if a.compute_from:
        compute_s.update(compute_from_csv(a.compute_from))
    for kv in a.compute:
        k, v = kv.split("=")
        compute_s[k] = float(v)
    rows = project(compute_s, a.bandwidths, a.latency_us * 1e-6, a.overlap, not a.no_per_layer, a.models)
    print(f"Projected speedup vs dense fp32 ring allreduce (alpha = {a.latency_us:g} us; "
          f"compute s/step: {', '.join(f'{m} {compute_s[m]:g}' for m in a.models)}; "
          f"{'overlap' if a.overlap else 'no overlap'}). Model prediction, assumed inputs.\n")
    print(markdown(rows, a.bandwidths, a.models))
    print("\nFrom which N a sparse reduce-scatter (alltoall to the owners, allgather of their "
          "re-selection) is predicted faster than the allgather of every message:\n")
    print(crossings(rows, a.bandwidths, a.models))
    if a.plot:
        plot(rows, a.bandwidths, a.models, a.plot)
        print(f"wrote {a.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
