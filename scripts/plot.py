"""Plot run folders: accuracy against steps and against cumulative wire bytes.

    python scripts/plot.py runs/demo/dense runs/demo/topk --out runs/demo/plots

Writes accuracy_vs_steps.png and accuracy_vs_wire_bytes.png (and loss_vs_steps.png).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on clusters or CI
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(folder: Path) -> tuple[list, list]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found; pass run folders written by redsync_hvd.train")
    evals, train = [], []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "test_accuracy" in rec:
            evals.append(rec)
        elif "loss" in rec:   # not the runner's events (checkpoint, resumed, stopped)
            train.append(rec)
    return evals, train


def label(folder: Path) -> str:
    summary = folder / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        c = s.get("compression", {})
        extra = f" d={c['density']}" if "density" in c else ""
        return f"{folder.name} ({c.get('method', '?')}{extra})"
    return folder.name


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: first run folder)")
    args = ap.parse_args(argv)
    out = args.out or args.runs[0]
    out.mkdir(parents=True, exist_ok=True)
    figs = {name: plt.subplots(figsize=(6, 4)) for name in ("accuracy_vs_steps", "accuracy_vs_wire_bytes",
                                                             "loss_vs_steps")}
    for folder in args.runs:
        evals, train = read_metrics(folder)
        name = label(folder)
        figs["accuracy_vs_steps"][1].plot([r["step"] for r in evals], [r["test_accuracy"] for r in evals],
                                          marker="o", ms=3, label=name)
        figs["accuracy_vs_wire_bytes"][1].plot([max(r["wire_bytes"], 1) for r in evals],
                                               [r["test_accuracy"] for r in evals], marker="o", ms=3, label=name)
        figs["loss_vs_steps"][1].plot([r["step"] for r in train], [r["loss"] for r in train], label=name)
    written = []
    for name, (fig, ax) in figs.items():
        ax.set_xlabel({"accuracy_vs_wire_bytes": "cumulative wire bytes per worker (log)"}.get(name, "step"))
        ax.set_ylabel("training loss" if name.startswith("loss") else "test accuracy")
        if name == "accuracy_vs_wire_bytes":
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
        print(path)
    return written


if __name__ == "__main__":
    main()
