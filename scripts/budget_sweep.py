"""The per-layer density budget against uniform density (2 workers, mean of seeds).

    python scripts/budget_sweep.py [--suite digits|digits-all|pydoc] [--np 2] [--seeds 0 1 2]
        [--out runs/budget] [--only NAME ...] [--set KEY=VALUE ...] [--resume] [--results DIR]

Each variant is ``horovodrun -np N python -m redsync_hvd.train --config <cfg> --set ...``, once
per seed; the budget variants run ``compression.policy.mode: budget`` with the bytes of uniform
density at the same density, so rows of one density send the same bytes (the budget also pays
its statistics out of them). The table gives the mean final accuracy (digits) or test
perplexity (pydoc) over the seeds, each seed's, the wire bytes per worker (all layers, and the
compressed layers alone) and the ratio to dense. ``--resume`` reads the runs whose summary.json
exists instead of running them again. ``--results DIR`` writes table.md, runs.json (each run's
figures and its budget choices) and machine.json there.

Suites:
  digits      configs/digits/redsync.yaml at 40 epochs (layers under 1024 elements dense),
              selection.method: radix (exactly k per layer, what a byte budget needs)
  digits-all  the same with every layer compressed (policy.min_compress_numel: 0: the biases
              and the first conv share the budget too) and no density warm-up, so the bytes
              are the policy's alone
  pydoc       configs/pydoc/redsync.yaml (the word-level LSTM, its density warm-up), every
              layer's message as values (quantize: none), selection.method: trimmed
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import REPO, job_env  # noqa: E402

RADIX = ["compression.selection.method=radix"]


def budget(method: str, extra: tuple = ()) -> list:
    return ["compression.policy.mode=budget", f"compression.policy.budget.method={method}", *extra]


def variants(base: list, densities: tuple, budget_densities: tuple, every: int) -> dict:
    out = {}
    for d in sorted(set(densities) | set(budget_densities)):
        out[f"uniform {d}"] = base + [f"compression.density={d}"]
    for d in budget_densities:
        for method in ("dp", "threshold"):
            out[f"budget {method} {d}"] = base + [f"compression.density={d}"] + budget(
                method, (f"compression.policy.budget.every={every}",))
    return out


DIGITS = ["training.epochs=40", *RADIX]
# every layer's message as values (a budget needs exactly k per layer; values are what an LSTM
# language model's embedding and decoder need), selected by the native trimmed search
PYDOC = ["compression.selection.method=trimmed", "compression.message.quantize=none", "compression.policy.layers=[]"]
SUITES = {
    "digits": ("configs/digits/redsync.yaml", "final_accuracy",
               variants(DIGITS, (0.001, 0.0015, 0.002, 0.004), (0.001,), 100)),
    "digits-all": ("configs/digits/redsync.yaml", "final_accuracy",
                   variants(DIGITS + ["compression.policy.min_compress_numel=0", "compression.warmup.epochs=0"],
                            (0.0015, 0.002, 0.003), (0.001,), 100)),
    "pydoc": ("configs/pydoc/redsync.yaml", "final_perplexity", variants(PYDOC, (0.0015, 0.002), (0.001,), 200)),
}


def run_name(name: str, seed: int) -> str:
    keep = "".join(c if c.isalnum() or c in "._-" else "_" for c in name.replace("=", "-"))
    return f"{keep}_s{seed}"


def run(cfg: str, sets: list, out: str, name: str, seed: int, np_: int, resume: bool) -> dict:
    summary = REPO / out / name / "summary.json"
    if not (resume and summary.is_file()):
        bindir = Path(sys.executable).parent
        cmd = [str(bindir / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", sys.executable, "-m",
               "redsync_hvd.train", "--config", cfg, "--set", f"output.dir={out}", "--set", f"output.name={name}",
               "--set", "training.progress=false", "--set", f"training.seed={seed}",
               "--set", "output.overwrite=true"]   # a run not kept (no --resume, or unfinished): again
        for o in sets:
            cmd += ["--set", o]
        env = job_env(OMPI_MCA_mpi_yield_when_idle="1")
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(summary.read_text())


def row(name: str, metric: str, runs: list) -> dict:
    values = [r[metric] for r in runs]
    detail = runs[0]["comm_detail"]
    return {"name": name, "values": values, "mean": sum(values) / len(values), "steps": runs[0]["steps"],
            "wire_mb": sum(r["wire_bytes"] for r in runs) / len(runs) / 1e6,
            "sparse_mb": sum(r["comm_detail"].get("wire_bytes[sparse]", 0) for r in runs) / len(runs) / 1e6,
            "budget_mb": sum(r["comm_detail"].get("bytes_budget", 0) for r in runs) / len(runs) / 1e6,
            "ratio": detail["dense_bytes"] / max(1, sum(r["wire_bytes"] for r in runs) / len(runs))}


def table(rows: list, metric: str, seeds: list) -> str:
    what = "accuracy" if metric == "final_accuracy" else "test perplexity"
    lines = [f"| variant | mean {what} | per seed ({' '.join(map(str, seeds))}) | wire MB/worker | "
             "compressed layers MB | of which statistics MB | ratio |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        per = " ".join(f"{v:.4f}" if metric == "final_accuracy" else f"{v:.1f}" for v in r["values"])
        mean = f"{r['mean']:.4f}" if metric == "final_accuracy" else f"{r['mean']:.2f}"
        lines.append(f"| {r['name']} | {mean} | {per} | {r['wire_mb']:.3f} | {r['sparse_mb']:.3f} | "
                     f"{r['budget_mb']:.4f} | {r['ratio']:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="digits")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--out", default="runs/budget")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--results", default=None, help="write table.md, runs.json and machine.json here")
    args = ap.parse_args()
    cfg, metric, suite = SUITES[args.suite]
    out = f"{args.out}/{args.suite}"
    rows, kept = [], {}
    for name, sets in suite.items():
        if args.only and name not in args.only:
            continue
        runs = []
        for seed in args.seeds:
            s = run(cfg, sets + args.overrides, out, run_name(name, seed), seed, args.np, args.resume)
            runs.append(s)
            kept[run_name(name, seed)] = keep(s, REPO / out / run_name(name, seed))
            print(f"{name} seed {seed}: {metric} {s[metric]:.4f} wire {s['wire_bytes']} ratio "
                  f"{s['compression_ratio']:.1f}", flush=True)
        rows.append(row(name, metric, runs))
    text = table(rows, metric, args.seeds)
    command = " ".join(["python scripts/budget_sweep.py", f"--suite {args.suite}", "--seeds",
                        *map(str, args.seeds)] + [f"--set {o}" for o in args.overrides])
    print(f"\n{command}\n\n{text}")
    if args.results:
        folder = Path(args.results)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "table.md").write_text(f"{command}\n\n{text}\n")
        (folder / "runs.json").write_text(json.dumps(kept, indent=1) + "\n")
        (folder / "machine.json").write_text(json.dumps(machine(), indent=1) + "\n")


def keep(s: dict, folder: Path) -> dict:
    """What a run's record keeps: its figures and, under a budget, each choice of k."""
    decisions = folder / "decisions.json"
    budget = json.loads(decisions.read_text()).get("budget") if decisions.is_file() else None
    out = {key: s.get(key) for key in ("final_accuracy", "final_perplexity", "final_loss", "wire_bytes",
                                       "dense_bytes", "compression_ratio", "steps", "wall_time_s")}
    if budget is not None:
        out["budget"] = {"bytes_per_step": budget["bytes_per_step"],
                         "history": [{"step": h["step"], "k": h["k"]} for h in budget["history"]]}
    return out


def machine() -> dict:
    import platform

    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "load_average": os.getloadavg()}


if __name__ == "__main__":
    main()
