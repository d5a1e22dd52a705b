#!/usr/bin/env python
"""RedSync under FSDP2 (``engine: fsdp``) against FSDP2's own dense reduce-scatter, on the configs'
own schedules: accuracy or perplexity, and the reduce-scatter bytes each rank sends.

    python scripts/fsdp_runs.py [--parts digits2 digits4 pydoc2] [--seeds 0 1 2] [--only KEY ...]
        [--runs runs/fsdp] [--out docs/results/<machine>-<date>/fsdp]

Every run is ``torchrun --standalone --nproc_per_node N -m redsync_hvd.train --config <cfg> --set
engine=fsdp ...`` (Gloo on the CPU; the YAML runner wraps every layer in ``fully_shard``), once per
seed (``training.seed``: for digits it also draws the train/test split, so each seed is a paired
comparison). Parts: ``digits2`` / ``digits4``: the digits CNN (configs/digits/*.yaml, 20 epochs)
on 2 / 4 ranks; ``pydoc2``: the pydoc LSTM (configs/pydoc/*.yaml, 1,500 steps) on 2 ranks.
A run whose summary.json exists is read, not run again, so an interrupted invocation resumes.
Bytes: ``wire_bytes`` of summary.json, what a rank put into the reduce-scatters (its shares for
the other ranks; dense: what FSDP2's own reduce-scatter sends, (N-1)/N of each group's buffer).
Writes, under --out: table.md, results.json, command.txt, machine.json, per-run/<run>/ (the
resolved config.yaml, summary.json and layers.log of every run).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import BIN, REPO, launch, write_outputs  # noqa: E402

D, P = "configs/digits/", "configs/pydoc/"
# key: (label, config, --set overrides); every row runs with engine=fsdp
ROWS = {
    "dense": ("FSDP2 dense (its own reduce-scatter)", "dense.yaml", []),
    "redsync": ("RedSync, the config's messages (`redsync.yaml`)", "redsync.yaml", []),
    "topk": ("top-k, the config's density (`topk.yaml`)", "topk.yaml", []),
    "fsdp": ("RedSync for FSDP (`fsdp.yaml`)", "fsdp.yaml", []),
    "fsdp-bf16": ("RedSync for FSDP, residuals in bf16", "fsdp.yaml", ["compression.residual_dtype=bf16"]),
    "redsync-bf16": ("RedSync (`redsync.yaml`), residuals in bf16", "redsync.yaml",
                     ["compression.residual_dtype=bf16"]),
}
PARTS = {   # name: (config folder, ranks, metric, rows that exist for it)
    "digits2": (D, 2, "test_accuracy", ("dense", "redsync", "topk", "redsync-bf16")),
    "digits4": (D, 4, "test_accuracy", ("dense", "redsync", "topk", "redsync-bf16")),
    "pydoc2": (P, 2, "perplexity", ("dense", "fsdp", "fsdp-bf16")),
}


def run_one(args, part: str, key: str, seed: int) -> dict:
    folder, nproc, _, _ = PARTS[part]
    label, config, sets = ROWS[key]
    name = f"{part}-{key}-s{seed}"
    run_dir = Path(args.runs) / name
    summary = run_dir / "summary.json"
    status = "ok"
    if not summary.exists():
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), "-m", "redsync_hvd.train",
               "--config", str(REPO / folder / config), "--set", "engine=fsdp", "--set", f"training.seed={seed}",
               "--set", f"output.dir={args.runs}", "--set", f"output.name={name}", "--set", "training.progress=false",
               *sum((["--set", s] for s in sets), [])]
        load = os.getloadavg()[0]
        status = launch(cmd, Path(args.runs) / f"{name}.log", args.timeout)
        print(f"{name}: {status} (load {load:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    if not summary.exists():
        return {"status": status if status != "ok" else "failed", "seed": seed}
    s = json.loads(summary.read_text())
    keep = Path(args.out) / "per-run" / name
    keep.mkdir(parents=True, exist_ok=True)
    for f in ("config.yaml", "summary.json", "layers.log"):
        if (run_dir / f).exists():
            shutil.copy(run_dir / f, keep / f)
    return {"status": "ok", "seed": seed, "accuracy": s.get("final_accuracy"), "perplexity": s.get("final_perplexity"),
            "wire_bytes": s["wire_bytes"], "dense_bytes": s["dense_bytes"], "ratio": s["compression_ratio"],
            "received_bytes": s["comm_detail"].get("bytes_received"), "steps": s["steps"], "wall_s": s["wall_time_s"]}


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def table(results: dict) -> str:
    lines = []
    for part, rows in results.items():
        _, nproc, metric, _ = PARTS[part]
        what = "test accuracy" if metric == "test_accuracy" else "test perplexity"
        field = "accuracy" if metric == "test_accuracy" else "perplexity"
        lines += [f"\n### {part}: {nproc} ranks\n",
                  f"| method | {what}, mean | per seed | vs dense | reduce-scatter MB sent per rank | "
                  "fewer bytes than dense | steps |", "|---|---:|---|---:|---:|---:|---:|"]
        base = mean([r[field] for r in rows.get("dense", []) if r["status"] == "ok"])
        for key, runs in rows.items():
            ok = [r for r in runs if r["status"] == "ok"]
            if not ok:
                lines.append(f"| {ROWS[key][0]} | {', '.join(r['status'] for r in runs)} | | | | | |")
                continue
            m = mean([r[field] for r in ok])
            if field == "accuracy":
                gap = f"{(m - base) * 100:+.2f} points" if base is not None else ""
                seeds = " ".join(f"{r[field]:.4f}" for r in ok)
                value = f"{m:.4f}"
            else:
                gap = f"{(m / base - 1) * 100:+.1f}%" if base else ""
                seeds = " ".join(f"{r[field]:.2f}" for r in ok)
                value = f"{m:.2f}"
            mb = mean([r["wire_bytes"] for r in ok]) / 1e6
            ratio = mean([r["dense_bytes"] for r in ok]) / mean([r["wire_bytes"] for r in ok])
            lines.append(f"| {ROWS[key][0]} | {value} | {seeds} | {gap} | {mb:,.2f} | {ratio:.1f}x | "
                         f"{ok[0]['steps']} |")
    return "\n".join(lines).lstrip() + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", choices=list(ROWS), help="rows to run (default: each part's own)")
    ap.add_argument("--runs", default="runs/fsdp", help="where the run folders go")
    ap.add_argument("--out", default=None, help="results folder (default: docs/results/cpu-<cores>cores-<date>/fsdp)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    a = ap.parse_args(argv)
    a.out = a.out or str(REPO / "docs" / "results" / f"cpu-{os.cpu_count()}cores-{time.strftime('%Y-%m-%d')}" / "fsdp")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    t0, loads = time.time(), [os.getloadavg()[0]]
    results: dict = {}
    for part in args.parts:
        keys = [k for k in PARTS[part][3] if args.only is None or k in args.only]
        for key in keys:
            results.setdefault(part, {})[key] = [run_one(args, part, key, s) for s in args.seeds]
            loads.append(os.getloadavg()[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(out, "scripts/fsdp_runs.py", argv, table(results), {"runs": results},
                  {"seeds": args.seeds, "parts": args.parts}, loads, t0)
    failed = [(p, k) for p, rs in results.items() for k, xs in rs.items() if any(x["status"] != "ok" for x in xs)]
    if failed:
        print(f"failed or timed out (rerun the same command to retry them): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
