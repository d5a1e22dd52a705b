"""Accuracy and compression of RedSync variants against dense on the digits CNN (2 workers).

    python scripts/digits_sweep.py [--np 2] [--out runs/sweep] [--seeds 0 1 2 3 4] [--only NAME ...]
        [--set KEY=VALUE ...] [--env KEY=VALUE ...] [--resume]

Each variant is `horovodrun -np N python -m redsync_hvd.train --config <cfg> --set ...`, once per
seed (`training.seed`; the seed also draws the train/test split, so each seed is a paired
comparison on its own 360-sample test set). The table at the end gives the per-seed accuracies,
their mean and the gap of the mean to the dense run with the same number of epochs; it is what
docs/redsync.md, docs/sbc.md and docs/iwp.md record.

``--set`` adds an override to every run (dense included), ``--env`` an environment variable:
both change the floating-point rounding without changing the method, the way another machine
does (``--set training.threads=2``; ``--env ONEDNN_MAX_CPU_ISA=AVX2 --env ATEN_CPU_CAPABILITY=avx2``:
oneDNN's and ATen's AVX2 kernels instead of AVX-512 ones). ``--resume`` reads runs whose
summary.json exists instead of running them again.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import REPO, job_env  # noqa: E402

RS = "configs/digits/redsync.yaml"
E40 = ["training.epochs=40"]
E80 = ["training.epochs=80"]
# configs/digits/{sbc,iwp}.yaml hold the documented settings; SBC0 and IWP0 are one density for
# every compressed layer and no per-layer overrides, the settings the variants below start from
SBC0 = ["compression.local_steps=10", "compression.density=0.01", "compression.policy.layers=[]"]
IWP0 = ["compression.density=0.01", "compression.policy.min_compress_numel=1024", "compression.policy.layers=[]"]
# the small layers (biases, the first conv, the output layer: 1.8k of 53k parameters) at a
# density that moves them every round, for a few dozen bytes
SMALL_LAYERS = (
    'compression.policy.layers=[{pattern: "*.bias", density: 0.25}, {pattern: "features.0.*", density: 0.25}, '
    '{pattern: "classifier.3.*", density: 0.05}]'
)
# ... denser still: the output layer and the biases move a quarter to half of their values per round
SMALL_LAYERS_2 = (
    'compression.policy.layers=[{pattern: "*.bias", density: 0.5}, {pattern: "features.0.*", density: 0.25}, '
    '{pattern: "classifier.3.*", density: 0.25}]'
)
# the peer work of scripts/compare_baselines.py (20 epochs, base.yaml): RedSync against PowerSGD
# rank 2 (23.1x there), spending the bytes of the density warm-up on the steady state instead
NOWU = ["compression.warmup.epochs=0"]
PEER = {
    "peer: redsync 0.01 sign_mean (redsync.yaml)": (RS, []),
    "peer: redsync 0.01 sign_mean, no warm-up": (RS, NOWU),
    "peer: redsync 0.02 sign_mean, no warm-up": (RS, NOWU + ["compression.density=0.02"]),
    "peer: redsync 0.03 sign_mean golomb, no warm-up": (
        RS, NOWU + ["compression.density=0.03", "compression.message.index_coding=golomb"]),
    "peer: redsync 0.01 sign_mean, warm-up 1 epoch": (RS, ["compression.warmup.epochs=1"]),
    "peer: redsync 0.01 sign_mean, threshold_reuse=1": (RS, ["compression.selection.threshold_reuse=1"]),
    "peer: redsync 0.01 sign_mean, no warm-up, threshold_reuse=1": (
        RS, NOWU + ["compression.selection.threshold_reuse=1"]),
    "peer: redsync 0.005 quantize=none, no warm-up": (
        RS, NOWU + ["compression.density=0.005", "compression.message.quantize=none"]),
    "peer: redsync 0.01 quantize=none, no warm-up": (RS, NOWU + ["compression.message.quantize=none"]),
    "peer: redsync 0.01 quantize=none": (RS, ["compression.message.quantize=none"]),
    "peer: redsync 0.01 fp16, no warm-up": (RS, NOWU + ["compression.message.quantize=fp16"]),
    "peer: redsync 0.02 quantize=none golomb, no warm-up": (
        RS, NOWU + ["compression.density=0.02", "compression.message.quantize=none",
                    "compression.message.index_coding=golomb"]),
}
VARIANTS = {
    **PEER,
    "dense": ("configs/digits/dense.yaml", []),
    "dense 40 epochs": ("configs/digits/dense.yaml", E40),
    "redsync 0.01 sign_mean 40 epochs": (RS, E40),
    # selection of a whole bucket at once (the CUDA default), against per-layer trimmed,
    # which also sends about k per layer (tbs sends k to 2k)
    "redsync 0.01 sign_mean 40 epochs, selection_scope=bucket": (RS, E40 + ["compression.selection.scope=bucket"]),
    "redsync 0.01 sign_mean 40 epochs, selection=trimmed": (RS, E40 + ["compression.selection=trimmed"]),
    # the sparse reduce-scatter against the allgather at the same density (docs/redsync.md, run with --np 4)
    "redsync 0.01 sign_mean 40 epochs, sparse_reduce_scatter": (
        RS, E40 + ["compression.aggregation=sparse_reduce_scatter"]),
    "redsync 0.01 quantize=none 40 epochs": (RS, E40 + ["compression.message.quantize=none"]),
    "redsync 0.01 quantize=none 40 epochs, sparse_reduce_scatter": (
        RS, E40 + ["compression.message.quantize=none", "compression.aggregation=sparse_reduce_scatter"]),
    "redsync 0.001 sign_mean 40 epochs (redsync-0.001.yaml)": ("configs/digits/redsync-0.001.yaml", E40),
    "redsync 0.001 sign_mean 40 epochs, no override": (RS, E40 + ["compression.density=0.001"]),
    "redsync 0.001 sign_mean 40 epochs, override, warmup_epochs=8": (
        "configs/digits/redsync-0.001.yaml",
        E40 + ["compression.warmup.epochs=8"],
    ),
    "redsync 0.001 sign_mean 40 epochs, override, threshold_reuse=1": (
        "configs/digits/redsync-0.001.yaml",
        E40 + ["compression.selection.threshold_reuse=1"],
    ),
    "redsync 0.001 quantize=none 40 epochs, override": (
        "configs/digits/redsync-0.001.yaml",
        E40 + ["compression.message.quantize=none"],
    ),
    "redsync 0.001 quantize=fp16 40 epochs, override": (
        "configs/digits/redsync-0.001.yaml",
        E40 + ["compression.message.quantize=fp16"],
    ),
    "redsync 0.001 sign_mean 40 epochs, override, every layer compressed, small layers 0.25": (
        "configs/digits/redsync-0.001.yaml",
        E40 + ["compression.policy.min_compress_numel=0", SMALL_LAYERS.replace('0.05}', '0.01}')],
    ),
    "redsync 0.001 sign_mean 40 epochs, override, momentum_correction": (
        "configs/digits/redsync-0.001.yaml",
        E40 + ["compression.dgc.momentum_correction=true"],
    ),
    "redsync 0.001 sign_mean 40 epochs, override, momentum_correction, no masking": (
        "configs/digits/redsync-0.001.yaml",
        E40 + ["compression.dgc.momentum_correction=true", "compression.dgc.momentum_masking=false"],
    ),
    "redsync 0.01 sign_mean 20 epochs": (RS, []),
    "redsync 0.001 sign_mean 20 epochs": (RS, ["compression.density=0.001"]),
    "redsync 0.01 20 epochs momentum_correction": (RS, ["compression.dgc.momentum_correction=true"]),
    "redsync 0.01 20 epochs momentum_correction, no masking": (
        RS,
        ["compression.dgc.momentum_correction=true", "compression.dgc.momentum_masking=false"],
    ),
    "sbc local_steps=10 density=0.01 40 epochs (the method's defaults)": ("configs/digits/sbc.yaml", SBC0 + E40),
    "sbc local_steps=13 density=0.01 40 epochs": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=13"],
    ),
    "sbc local_steps=13 density=0.01 40 epochs lr=0.1": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=13", "optimizer.lr=0.1"],
    ),
    "iwp density=0.01 min_compress_numel=0 40 epochs": (
        "configs/digits/iwp.yaml",
        IWP0 + E40 + ["compression.policy.min_compress_numel=0"],
    ),
    "topk 0.01": ("configs/digits/topk.yaml", []),
    "redsync 0.01 quantize=none 20 epochs": (RS, ["compression.message.quantize=none"]),
    "redsync 0.001 quantize=none 20 epochs": (RS, ["compression.density=0.001", "compression.message.quantize=none"]),
    "redsync 0.01 fp16 20 epochs": (RS, ["compression.message.quantize=fp16"]),
    "redsync 0.001 sign_rule=larger 20 epochs": (
        RS,
        ["compression.density=0.001", "compression.message.sign_rule=larger"],
    ),
    "sbc local_steps=10 density=0.01": ("configs/digits/sbc.yaml", SBC0 + []),
    "sbc local_steps=10 density=0.01 binarize=false": (
        "configs/digits/sbc.yaml",
        SBC0 + ["compression.message.binarize=false"],
    ),
    "sbc local_steps=5 density=0.01": ("configs/digits/sbc.yaml", SBC0 + ["compression.local_steps=5"]),
    "sbc local_steps=10 density=0.02": ("configs/digits/sbc.yaml", SBC0 + ["compression.density=0.02"]),
    "iwp density=0.01": ("configs/digits/iwp.yaml", IWP0 + []),
    "iwp density=0.05": ("configs/digits/iwp.yaml", IWP0 + ["compression.density=0.05"]),
    "iwp density=0.02 min_compress_numel=0": (
        "configs/digits/iwp.yaml",
        IWP0 + ["compression.density=0.02", "compression.policy.min_compress_numel=0"],
    ),
    # the documented settings, as the config files hold them (docs/sbc.md, docs/iwp.md)
    "sbc.yaml 40 epochs": ("configs/digits/sbc.yaml", E40),
    "iwp.yaml 40 epochs": ("configs/digits/iwp.yaml", E40),
    # what limits SBC and IWP at their target ratios (40 epochs)
    "dense 80 epochs": ("configs/digits/dense.yaml", E80),
    "sbc local_steps=13 density=1.0 binarize=false 40 epochs (local SGD only)": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=13", "compression.density=1.0", "compression.message.binarize=false"],
    ),
    "sbc local_steps=1 density=0.01 40 epochs (no delay)": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=1"],
    ),
    "sbc local_steps=13 density=0.01 40 epochs, small layers 0.25": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=13", SMALL_LAYERS],
    ),
    "sbc local_steps=13 density=0.01 40 epochs, min_compress_numel=4096": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=13", "compression.policy.min_compress_numel=4096"],
    ),
    "sbc local_steps=13 density=0.01 40 epochs binarize=false, small layers 0.25": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=13", "compression.message.binarize=false", SMALL_LAYERS],
    ),
    "sbc local_steps=20 density=0.02 40 epochs, small layers 0.25": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=20", "compression.density=0.02", SMALL_LAYERS],
    ),
    "sbc local_steps=14 density=0.01 40 epochs, small layers 0.25-0.5": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=14", SMALL_LAYERS_2],
    ),
    "sbc local_steps=21 density=0.02 40 epochs, small layers 0.25": (
        "configs/digits/sbc.yaml",
        SBC0 + E40 + ["compression.local_steps=21", "compression.density=0.02", SMALL_LAYERS],
    ),
    "sbc local_steps=13 density=0.01 80 epochs": (
        "configs/digits/sbc.yaml",
        SBC0 + E80 + ["compression.local_steps=13"],
    ),
    "iwp density=0.01 min_compress_numel=0 40 epochs eps=1": (
        "configs/digits/iwp.yaml",
        IWP0 + E40 + ["compression.policy.min_compress_numel=0", "compression.eps=1.0"],
    ),
    "iwp density=0.01 min_compress_numel=0 40 epochs, small layers 0.25": (
        "configs/digits/iwp.yaml",
        IWP0 + E40 + ["compression.policy.min_compress_numel=0", SMALL_LAYERS],
    ),
    "iwp density=0.0075 min_compress_numel=0 40 epochs, small layers 0.25": (
        "configs/digits/iwp.yaml",
        IWP0 + E40 + ["compression.density=0.0075", "compression.policy.min_compress_numel=0", SMALL_LAYERS],
    ),
    "iwp density=0.01 min_compress_numel=0 80 epochs": (
        "configs/digits/iwp.yaml",
        IWP0 + E80 + ["compression.policy.min_compress_numel=0"],
    ),
}


def run_name(name: str, seed: int) -> str:
    keep = "".join(c if c.isalnum() or c in "._-" else "_" for c in name.replace("=", "-"))
    return f"{keep}_s{seed}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--out", default="runs/sweep")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    env = job_env(OMPI_MCA_mpi_yield_when_idle="1", **dict(e.split("=", 1) for e in args.env))
    bindir = Path(sys.executable).parent
    rows = []
    for name, (cfg, sets) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        accs, s = [], {}
        for seed in args.seeds:
            run = run_name(name, seed)
            cmd = [str(bindir / "horovodrun"), "-np", str(args.np), "-H", f"localhost:{args.np}", sys.executable,
                   "-m", "redsync_hvd.train", "--config", cfg, "--set", f"output.dir={args.out}", "--set",
                   f"output.name={run}", "--set", "training.progress=false", "--set", f"training.seed={seed}",
                   "--set", "output.overwrite=true"]   # a run not kept (no --resume, or unfinished): again
            for o in sets + args.overrides:
                cmd += ["--set", o]
            summary = REPO / args.out / run / "summary.json"
            if not (args.resume and summary.is_file()):
                subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
            s = json.loads(summary.read_text())
            accs.append(s["final_accuracy"])
            print(f"{name} seed {seed}: accuracy {s['final_accuracy']:.4f} ratio {s['compression_ratio']:.1f}",
                  flush=True)
        rows.append((name, accs, sum(accs) / len(accs), s["compression_ratio"], s["steps"]))
    dense = {steps: mean for name, _, mean, _, steps in rows if name.startswith("dense")}
    print(f"\nseeds {args.seeds}; gap = dense mean - variant mean at the same number of steps (points)\n")
    print("| variant | accuracy per seed | mean | gap to dense (points) | compression ratio |")
    print("|---|---|---|---|---|")
    for name, accs, mean, ratio, steps in rows:
        gap = f"{100 * (dense[steps] - mean):+.2f}" if steps in dense else "n/a"
        print(f"| {name} | {' '.join(f'{a:.4f}' for a in accs)} | {mean:.4f} | {gap} | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
