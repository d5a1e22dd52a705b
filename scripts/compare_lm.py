#!/usr/bin/env python
"""Every method on the pydoc language model (configs/pydoc/), in one invocation: one table, two plots.

    python scripts/compare_lm.py [--seeds 0 1 2] [--only KEY ...] [--runs runs/compare_lm]
        [--out docs/results/<machine>-<date>/pydoc] [--steps N] [--quick]

Each row is one config of configs/pydoc/ (with --set overrides), run as
``horovodrun -np 2 python -m redsync_hvd.train`` once per seed, all for the same number of steps
(configs/pydoc/base.yaml: a word-level 2-layer LSTM on CPython's reference text, 2 workers).
Every launch has a timeout and kills its whole session on expiry; a finished run (its
summary.json) is read back, not run again, and a run stopped part-way goes on from its last
checkpoint (saved every 5 minutes), so an interrupted invocation resumes where it stopped.
``--quick``: one seed, a few steps of a small model: a smoke test of the whole path.

Per row: the mean over the seeds of the test perplexity at the last step (``final_perplexity``
of summary.json), each seed's, how far it is from dense's mean, the bytes one worker put into
collectives over the run and the ratio against dense fp32. Writes, under --out: table.md,
results.json, perplexity_vs_bytes.png, perplexity_vs_steps.png, command.txt, machine.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import BIN, REPO, launch, machine_info, write_outputs  # noqa: E402

P = "configs/pydoc/"
ALL_SIGN_MEAN, ALL_VALUES = ("compression.policy.layers=[]", "compression.message.quantize=sign_mean"), \
    ("compression.policy.layers=[]", "compression.message.quantize=none")   # one message for every layer
FP16_VALUES = ("compression.policy.layers=[{pattern: 'embedding.*', quantize: fp16}, "
               "{pattern: 'decoder.*', quantize: fp16}]")   # redsync.yaml's values layers, in fp16


FP16_ALL = ("compression.policy.layers=[]", "compression.message.quantize=fp16", "compression.policy.dense_values=fp16")
FLAT = "compression.warmup.epochs=0"   # the target density from the first step


def fp16_row(label: str, *sets: str) -> tuple:
    """redsync-compact.yaml with fp16 values for every compressed layer and fp16 biases, then ``sets``."""
    positions = "" if "compression.message.index_coding=raw" in sets else ", Golomb positions"
    return (f"{label}, fp16 values and biases{positions}", P + "redsync-compact.yaml", [*FP16_ALL, *sets])


def warmup_row(epochs: int, start: float, what: str) -> tuple:
    """redsync.yaml with its density warm-up from ``start`` over ``epochs`` epochs, one stage an epoch."""
    return (f"RedSync 0.1%, {what}from {start:.1%} over {epochs} epochs in {epochs} stages", P + "redsync.yaml",
            [f"compression.warmup.epochs={epochs}", f"compression.warmup.stages={epochs}",
             f"compression.warmup.start_density={start}"])


# key: (label, config, --set overrides)
ROWS = {
    "dense": ("dense fp32", P + "dense.yaml", []),
    "redsync": ("RedSync 0.1% (`redsync.yaml`)", P + "redsync.yaml", []),
    "redsync-paper": ("RedSync 0.1%, sign-mean everywhere, momentum correction", P + "redsync.yaml",
                      [*ALL_SIGN_MEAN, "compression.dgc.momentum_correction=true", "compression.residual_lr=send"]),
    # what each part of the old defaults costs (docs/redsync.md, "Language models")
    "redsync-sm": ("RedSync 0.1%, sign-mean everywhere", P + "redsync.yaml", [*ALL_SIGN_MEAN]),
    "redsync-values-mc": ("RedSync 0.1%, values everywhere, momentum correction", P + "redsync.yaml",
                          [*ALL_VALUES, "compression.dgc.momentum_correction=true"]),
    "redsync-values-mc-nomask": ("RedSync 0.1%, values everywhere, momentum correction without masking",
                                 P + "redsync.yaml", [*ALL_VALUES, "compression.dgc.momentum_correction=true",
                                                      "compression.dgc.momentum_masking=false"]),
    "redsync-values": ("RedSync 0.1%, values everywhere", P + "redsync.yaml", [*ALL_VALUES]),
    "redsync-lr-send": ("RedSync 0.1%, residual applied at the sending step's learning rate (residual_lr: send)",
                        P + "redsync.yaml", ["compression.residual_lr=send"]),
    # how long the density warm-up lasts (docs/redsync.md, "Language models"; redsync.yaml: 12 epochs from 0.8%)
    **{f"redsync-warmup{epochs}": warmup_row(epochs, start, what)
       for epochs, start, what in ((4, 0.016, "DGC's warm-up: "), (8, 0.016, "density warm-up "),
                                   (12, 0.008, "density warm-up "), (20, 0.006, "density warm-up "))},
    # the same bytes in smaller messages: fp16 values, Golomb-coded positions, so more of them
    **{f"redsync-compact{int(d * 1e4)}": (
        f"RedSync {d:.2%}, fp16 values and Golomb-coded positions, warm-up from {start:.1%}", P + "redsync.yaml",
        [f"compression.density={d}", f"compression.warmup.start_density={start}",
         "compression.message.index_coding=golomb",
         FP16_VALUES])
       for d, start in ((0.002, 0.008), (0.0025, 0.02), (0.003, 0.008), (0.006, 0.008))},
    # redsync-compact.yaml with fp16 biases, and the bytes that frees spent on a denser warm-up
    **{f"redsync-compact60-early{int(start * 1e3)}x{epochs}": (
        f"RedSync 0.60%, fp16 values and biases, Golomb positions, warm-up from {start:.0%} over {epochs} epochs",
        P + "redsync-compact.yaml",
        ["compression.policy.dense_values=fp16", f"compression.warmup.start_density={start}",
         f"compression.warmup.epochs={epochs}", f"compression.warmup.stages={epochs}"])
       for start, epochs in ((0.04, 6), (0.03, 12))},
    # fp16 values for every layer and fp16 biases (redsync-fp16.yaml is the emb30-flat row), at 0.6% with
    # the warm-up, then what the bytes left to 100x buy: density, flat from the first step, or split
    "redsync-compact60-fp16": fp16_row("RedSync 0.60%"),
    "redsync-fp16-70": fp16_row("RedSync 0.70%", "compression.density=0.007"),
    "redsync-fp16-75-flat": fp16_row("RedSync 0.75% from the first step", "compression.density=0.0075", FLAT),
    **{f"redsync-fp16-emb{int(emb * 1e4)}-flat": fp16_row(
        f"RedSync from the first step, {emb:.1%} of the embedding and {rest:.2%} of the other layers (0.75%'s "
        "positions)", f"compression.density={rest}", FLAT,
        f"compression.policy.layers=[{{pattern: 'embedding.*', density: {emb}}}]")
       for emb, rest in ((0.001, 0.0102), (0.003, 0.0094), (0.014, 0.0048))},
    # the budget on fp16 messages: it needs exactly k and raw positions to hold a byte count
    "uniform-fp16-radix": fp16_row("RedSync 0.4% from the first step, exactly k (radix), raw positions",
                                   "compression.density=0.004", FLAT, "compression.selection.method=radix",
                                   "compression.message.index_coding=raw"),
    "budget-fp16-radix": fp16_row("budget policy (dp) at uniform 0.4%'s bytes, exactly k (radix), raw positions",
                                  "compression.density=0.004", FLAT, "compression.selection.method=radix",
                                  "compression.message.index_coding=raw", "compression.policy.mode=budget"),
    "descent-fp16-radix": fp16_row("budget policy (dp, objective descent: what each k buys the loss) at uniform "
                                   "0.4%'s bytes, exactly k (radix), raw positions",
                                   "compression.density=0.004", FLAT, "compression.selection.method=radix",
                                   "compression.message.index_coding=raw", "compression.policy.mode=budget",
                                   "compression.policy.budget.objective=descent"),
    "powersgd": ("PowerSGD rank 1", P + "powersgd.yaml", []),
    "topk": ("top-k 0.1%", P + "topk.yaml", []),
    "sbc": ("SBC", P + "sbc.yaml", []),
    "uniform-values": ("RedSync 0.1%, values everywhere, trimmed selection: uniform density at the budget's bytes",
                       P + "redsync.yaml", ["compression.selection.method=trimmed", *ALL_VALUES]),
    "adaptive": ("budget policy (`adaptive.yaml`: the same bytes, chosen per layer)", P + "adaptive.yaml", []),
}
QUICK = ["training.steps=6", "training.eval_every=3", "model.options={embed_dim: 16, hidden: 16, num_layers: 2}"]


def machine_name() -> str:
    """cpu-<vendor>-<cores>cores, e.g. cpu-epyc-2cores (the CPU model from /proc/cpuinfo)."""
    cpu = machine_info()["cpu"].lower()
    vendor = next((v for v in ("epyc", "xeon", "ryzen", "core") if v in cpu), "x86")
    return f"cpu-{vendor}-{os.cpu_count()}cores"


def run_one(args, key: str, seed: int) -> dict:
    """One run of one row (a run folder with a summary.json is read, not rerun)."""
    label, config, sets = ROWS[key]
    name = f"{key}-s{seed}"
    folder = Path(args.runs) / name
    summary = folder / "summary.json"
    if not summary.is_file():
        if not (REPO / config).is_file():
            return {"status": "no config"}
        extra = [f"output.dir={args.runs}", f"output.name={name}", "training.progress=false",
                 f"training.seed={seed}", f"training.checkpoint_every_s={0 if args.quick else 300}"]
        extra += QUICK if args.quick else [f"training.steps={args.steps}"] if args.steps else []
        if (folder / "checkpoint-rank0.pt").is_file():   # an invocation stopped mid-run: go on from its last save
            extra.append(f"training.resume={folder}")
        else:   # none, or one stopped before its first save: the row again, from the start
            extra.append("output.overwrite=true")
        if args.quick and key in ("sbc",):
            extra.append("compression.local_steps=2")
        cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable, "-m", "redsync_hvd.train",
               "--config", str(REPO / config)] + [a for s in sets + extra for a in ("--set", s)]
        load0 = os.getloadavg()[0]
        status = launch(cmd, Path(args.runs) / "logs" / f"{name}.log", args.timeout)
        print(f"pydoc {name}: {status}", flush=True)
        if status != "ok" or not summary.is_file():
            return {"status": status}
        for ckpt in folder.glob("checkpoint-*"):
            ckpt.unlink()
        (folder / "load.json").write_text(json.dumps({"load_before": load0, "load_after": os.getloadavg()[0]}))
    s = json.loads(summary.read_text())
    load = json.loads((folder / "load.json").read_text()) if (folder / "load.json").is_file() else {}
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    curve = [(r["step"], r["test_perplexity"]) for r in map(json.loads, lines) if "test_perplexity" in r]
    return {"status": "ok", "perplexity": s["final_perplexity"], "loss": s["final_loss"], "wire_bytes": s["wire_bytes"],
            "dense_bytes": s["dense_bytes"], "ratio": float(s["compression_ratio"]), "steps": s["steps"],
            "wall_s": s["wall_time_s"], "python": s["data"]["python"], "text_sha256": s["data"]["text_sha256"],
            "curve": curve, **load}


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def aggregate(results: dict) -> dict:
    rows = {}
    for key, runs in results.items():
        ok = [r for r in runs if r.get("status") == "ok"]
        if ok:
            rows[key] = {"label": ROWS[key][0], "config": ROWS[key][1], "sets": ROWS[key][2],
                         "perplexity": mean([r["perplexity"] for r in ok]),
                         "perplexities": [r["perplexity"] for r in ok],
                         "wire_bytes": mean([r["wire_bytes"] for r in ok]),
                         "dense_bytes": mean([r["dense_bytes"] for r in ok]), "steps": ok[0]["steps"],
                         "seeds_done": len(ok)}
    dense = rows.get("dense")
    for r in rows.values():
        r["ratio"] = dense["wire_bytes"] / r["wire_bytes"] if dense else r["dense_bytes"] / r["wire_bytes"]
        r["vs_dense"] = r["perplexity"] / dense["perplexity"] - 1 if dense else None
    return rows


def table(rows: dict) -> str:
    lines = ["| method | test perplexity, mean | per seed | vs dense | MB/worker | ratio | steps |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows.values():
        vs = "-" if r["vs_dense"] is None else f"{100 * r['vs_dense']:+.1f}%"
        lines.append(f"| {r['label']} | {r['perplexity']:.2f} | {' '.join(f'{p:.2f}' for p in r['perplexities'])} | "
                     f"{vs} | {r['wire_bytes'] / 1e6:.2f} | {r['ratio']:.1f}x | {r['steps']} |")
    return "\n".join(lines) + "\n"


def plots(rows: dict, results: dict, out: Path) -> None:
    """Perplexity against bytes (one point per row) and against steps (seed means of the evaluations)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(sorted(rows.values(), key=lambda r: r["wire_bytes"])):
        ax.scatter(r["wire_bytes"] / 1e6, r["perplexity"])
        ax.annotate(r["label"], (r["wire_bytes"] / 1e6, r["perplexity"]), fontsize=7, xytext=(5, 3 + 9 * (i % 2)),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker over the run (MB, log scale)")
    ax.set_ylabel("test perplexity, mean of seeds")
    ax.set_title("pydoc word-level LSTM, 2 workers: perplexity against bytes")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "perplexity_vs_bytes.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 5))
    for key, r in rows.items():
        curves = [dict(x["curve"]) for x in results[key] if x.get("status") == "ok"]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        ax.plot(steps, [mean([c[s] for c in curves]) for s in steps], label=r["label"])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("test perplexity, mean of seeds (log scale)")
    ax.set_title("pydoc word-level LSTM, 2 workers")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "perplexity_vs_steps.png", dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", choices=list(ROWS), default=list(ROWS), metavar="KEY",
                    help=f"rows to run: {', '.join(ROWS)} (a row whose config is missing is left out)")
    ap.add_argument("--steps", type=int, default=None, help="override training.steps of every row")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per launch before its session is killed")
    ap.add_argument("--runs", default=None, help="run folders (resumable; not for committing); default "
                    "runs/compare_lm, or runs/compare_lm-quick with --quick, so that a later full invocation does not "
                    "read a quick run's folder as done")
    ap.add_argument("--out", default=None, help="default: docs/results/<machine>-<date>/pydoc")
    ap.add_argument("--quick", action="store_true", help="one seed, 6 steps of a small model")
    args = ap.parse_args(argv)
    if args.runs is None:
        args.runs = "runs/compare_lm-quick" if args.quick else "runs/compare_lm"
    if args.quick:
        args.seeds = args.seeds[:1]
    if args.out is None:
        args.out = str(REPO / "docs/results" / f"{machine_name()}-{datetime.date.today()}" / "pydoc")
    return args


def main(argv=None) -> int:
    """1. every (row, seed) not yet done, seeds in the outer loop (a partial invocation has whole
    seeds); 2. aggregate; 3. table, plots, command, machine."""
    args = parse_args(argv)
    t0, loads = time.time(), [os.getloadavg()[0]]
    results: dict = {key: [] for key in args.only}
    for seed in args.seeds:                                                                       # 1.
        for key in args.only:
            results[key].append(run_one(args, key, seed))
            loads.append(os.getloadavg()[0])
    results = {k: v for k, v in results.items() if any(r["status"] != "no config" for r in v)}
    rows = aggregate(results)                                                                     # 2.
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(rows)                                                                            # 3.
    write_outputs(out, "scripts/compare_lm.py", argv, text, {"rows": rows, "runs": results},
                  {"seeds": args.seeds, "quick": args.quick}, loads, t0)
    if rows:
        plots(rows, results, out)
    failed = [(k, i) for k, rs in results.items() for i, r in enumerate(rs) if r["status"] not in ("ok",)]
    if failed:
        print(f"failed or timed out (rerun the same command to retry them): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
