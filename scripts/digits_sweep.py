"""Accuracy and compression of RedSync variants against dense on the digits CNN (2 workers).

    python scripts/digits_sweep.py [--np 2] [--out runs/sweep] [--only NAME ...]

Each variant is `horovodrun -np N python -m redsync_hvd.train --config <cfg> --set ...`;
the table at the end is what docs/redsync.md records.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RS = "configs/digits/redsync.yaml"
VARIANTS = {
    "dense": ("configs/digits/dense.yaml", []),
    "topk 0.01": ("configs/digits/topk.yaml", []),
    "redsync 0.01 sign_mean": (RS, []),
    "redsync 0.001 sign_mean": (RS, ["compression.density=0.001"]),
    "redsync 0.01 quantize=none": (RS, ["compression.quantize=none"]),
    "redsync 0.001 quantize=none": (RS, ["compression.density=0.001", "compression.quantize=none"]),
    "redsync 0.01 fp16": (RS, ["compression.quantize=fp16"]),
    "redsync 0.01 momentum_correction sign_rule=larger": (RS, ["compression.sign_rule=larger", "compression.momentum_correction=true"]),
    "redsync 0.01 momentum_correction": (RS, ["compression.momentum_correction=true"]),
    "sbc local_steps=10 density=0.01": ("configs/digits/sbc.yaml", []),
    "sbc local_steps=10 density=0.01 binarize=false": ("configs/digits/sbc.yaml", ["compression.binarize=false"]),
    "sbc local_steps=5 density=0.01": ("configs/digits/sbc.yaml", ["compression.local_steps=5"]),
    "sbc local_steps=10 density=0.02": ("configs/digits/sbc.yaml", ["compression.density=0.02"]),
    "iwp density=0.01": ("configs/digits/iwp.yaml", []),
    "iwp density=0.05": ("configs/digits/iwp.yaml", ["compression.density=0.05"]),
    "iwp density=0.02 min_compress_numel=0": ("configs/digits/iwp.yaml", ["compression.density=0.02",
                                                                          "compression.min_compress_numel=0"]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--out", default="runs/sweep")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    bindir = Path(sys.executable).parent
    rows = []
    for name, (cfg, sets) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        run = name.replace(" ", "_").replace("=", "-")
        cmd = [str(bindir / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}", sys.executable, "-m",
               "redsync_hvd.train", "--config", cfg, "--set", f"output.dir={args.out}", "--set",
               f"output.name={run}", "--set", "training.progress=false"]
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        s = json.loads((REPO / args.out / run / "summary.json").read_text())
        rows.append((name, s["final_accuracy"], s["compression_ratio"], s["wire_bytes"]))
        print(f"{name}: accuracy {s['final_accuracy']:.4f} ratio {s['compression_ratio']:.1f}", flush=True)
    dense = dict((r[0], r[1]) for r in rows).get("dense")
    print("\n| variant | test accuracy | gap to dense (points) | compression ratio | wire MB/worker |")
    print("|---|---|---|---|---|")
    for name, acc, ratio, wire in rows:
        gap = f"{100 * (dense - acc):+.2f}" if dense is not None else "n/a"
        print(f"| {name} | {acc:.4f} | {gap} | {ratio:.1f}x | {wire / 1e6:.2f} |")


if __name__ == "__main__":
    main()
