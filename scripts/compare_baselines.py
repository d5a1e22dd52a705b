#!/usr/bin/env python
"""Every method on identical work, in one invocation: one table and one plot.

    python scripts/compare_baselines.py [--seeds 0 1 2] [--only KEY ...] [--parts digits vgg_fc4096 lstm_lm]
        [--runs runs/compare] [--out docs/results/<machine>-<date>/compare_baselines] [--quick]

Parts:
  1. ``digits``: the digits CNN, 2 workers, 20 epochs, batch 32 per worker, lr 0.05, momentum 0.9
     (configs/digits/base.yaml), once per seed; the accuracy is the mean over the seeds (the
     seed also draws the train/test split: each seed is a paired comparison on its own test set).
  2. ``vgg_fc4096`` and ``lstm_lm``: the same compression configs on two communication-bound
     models with synthetic inputs, ``--timed-steps`` steps each (42: two of SBC's 21-step rounds):
     bytes per step and step time.
Horovod rows run ``horovodrun -np 2 python -m redsync_hvd.train``; DDP rows run
``torchrun --nproc_per_node 2 scripts/ddp_worker.py`` (the same loop, data order and seed;
plain DDP and Horovod's dense train bit-identical weights). Every launch has a timeout and
kills its whole session on expiry; a finished run (its summary.json) is not run again, so an
interrupted invocation resumes where it stopped. ``--quick``: one seed, a few steps, small
synthetic models: a smoke test of the whole path (seconds per launch).

Step time = (training wall time - evaluation time) / steps, measured on rank 0 by the runner:
forward, backward, compression, communication and the optimizer step, the first (warm-up)
step included; the machine's load average is recorded beside it (machine.json).
Writes, under --out: table.md, results.json, accuracy_vs_bytes.png, command.txt, machine.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
D = "configs/digits/"
# key: (label, engine, config, --set overrides, ddp_worker.py arguments)
ROWS = {
    "dense": ("dense fp32", "horovod", D + "dense.yaml", [], []),
    "dense-ddp": ("dense fp32 (DDP)", "ddp", D + "dense.yaml", [], ["--hook", "none"]),
    "fp16": ("fp16", "horovod", D + "fp16.yaml", [], []),
    "powersgd-torch": ("PowerSGD r2, torch's hook (DDP)", "ddp", D + "dense.yaml", [],
                       ["--hook", "torch_powersgd", "--powersgd-rank", "2", "--powersgd-start", "2"]),
    "powersgd": ("PowerSGD r2, ours", "horovod", D + "powersgd.yaml", [], []),
    "powersgd-ddp": ("PowerSGD r2, ours (DDP)", "ddp", D + "powersgd.yaml", [], ["--hook", "ours"]),
    "signsgd": ("EF-signSGD", "horovod", D + "signsgd.yaml", [], []),
    "qsgd": ("QSGD 4 bits", "horovod", D + "qsgd.yaml", [], []),
    "topk": ("top-k 1%", "horovod", D + "topk.yaml", [], []),
    "redsync": ("RedSync 1%, sign_mean", "horovod", D + "redsync.yaml", [], []),
    "redsync-nowarmup": ("RedSync 1%, sign_mean, no warm-up", "horovod", D + "redsync.yaml",
                         ["compression.warmup.epochs=0"], []),
    "sbc": ("SBC", "horovod", D + "sbc.yaml", [], []),
    "iwp": ("IWP", "horovod", D + "iwp.yaml", [], []),
}
SYNTHETIC = {   # part: (--set overrides, quick-mode overrides)
    "vgg_fc4096": (["model.name=vgg", "model.options={fc_width: 4096, width: 0.25}", "data.name=synthetic",
                    "data.options={input_shape: [3, 32, 32], num_samples: 4096, num_test: 256}",
                    "training.batch_size=16"],
                   ["model.options={fc_width: 64, width: 0.125}"]),
    "lstm_lm": (["model.name=lstm_lm", "model.options={embed_dim: 650, hidden: 650, num_layers: 2, dropout: 0.2}",
                 "data.name=synthetic_lm", "data.options={vocab_size: 10000, num_tokens: 100000, seq_len: 35}",
                 "training.batch_size=20"],
                ["model.options={embed_dim: 32, hidden: 32, num_layers: 2, dropout: 0.2}",
                 "data.options={vocab_size: 500, num_tokens: 20000, seq_len: 35}"]),
}


def machine_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0).split()[-1].lower()
    except ImportError:
        pass
    return f"cpu-{os.cpu_count()}cores"


def machine_info() -> dict:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "workers": 2}


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a launch started with start_new_session): mpirun
    puts ranks in process groups of their own, so killing the launcher's group is not enough."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def command(engine: str, config: str, sets: list, worker_args: list) -> list:
    if engine == "horovod":
        cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", sys.executable, "-m", "redsync_hvd.train"]
    else:
        cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(REPO / "scripts/ddp_worker.py"),
               *worker_args]
    cmd += ["--config", str(REPO / config)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def outside_mpi(env: dict) -> dict:
    """``env`` without what an MPI singleton (a caller that imported mpi4py) set for itself:
    with those, the mpirun under horovodrun takes itself for one of its ranks and exits 1
    without a word. A user's own OMPI_MCA_* settings stay."""
    if "PMIX_NAMESPACE" not in env:
        return env
    own = ("PMIX_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_APP_CTX_", "OMPI_COMM_WORLD_")
    return {k: v for k, v in env.items() if not k.startswith(own)}


def job_env(**extra: str) -> dict:
    """The environment every script here gives a horovodrun/torchrun job: this repository and
    its venv first, root allowed, TensorFlow quiet, no inherited MPI singleton; then ``extra``."""
    return {**outside_mpi(dict(os.environ)), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            **extra}


def launch(cmd: list, log: Path, timeout: float) -> str:
    """Run one job with a hard timeout; its output goes to ``log``. Returns "ok", "failed" or "timeout"."""
    env = job_env(OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            proc.wait()
            out.write(f"\n[killed after the {timeout:g} s timeout]\n")
            return "timeout"
        if code != 0:   # the log then says how it ended, also when the job printed nothing
            out.write(f"\n[exit code {code}]\n")
    return "ok" if code == 0 else "failed"


def run_one(args, part: str, key: str, seed: int) -> dict:
    """One run of one row (resumed: a run folder with a summary.json is read, not rerun)."""
    label, engine, config, sets, worker_args = ROWS[key]
    name = f"{key}-s{seed}"
    folder = Path(args.runs) / part / name
    summary = folder / "summary.json"
    if not summary.is_file():
        extra = [f"output.dir={Path(args.runs) / part}", f"output.name={name}", "training.progress=false",
                 f"training.seed={seed}", "output.overwrite=true"]   # an unfinished run of this row: again
        if part == "digits":
            extra += ["training.steps=8"] if args.quick else []
        else:
            over, quick = SYNTHETIC[part]
            extra += over + (quick if args.quick else []) + [f"training.steps={args.timed_steps}"]
        load0 = os.getloadavg()[0]
        status = launch(command(engine, config, sets + extra, worker_args), Path(args.runs) / "logs" /
                        part / f"{name}.log", args.timeout)
        for ckpt in folder.glob("checkpoint-*.pt"):   # hundreds of MB for the big models; not needed
            ckpt.unlink()
        print(f"{part} {name}: {status}", flush=True)
        if status != "ok" or not summary.is_file():
            return {"status": status}
        (folder / "load.json").write_text(json.dumps({"load_before": load0, "load_after": os.getloadavg()[0]}))
    s = json.loads(summary.read_text())
    load = json.loads((folder / "load.json").read_text()) if (folder / "load.json").is_file() else {}
    t = s["time_breakdown"]
    return {"status": "ok", "accuracy": s["final_accuracy"], "loss": s["final_loss"], "wire_bytes": s["wire_bytes"],
            "dense_bytes": s["dense_bytes"], "ratio": float(s["compression_ratio"]), "steps": s["steps"],
            "step_s": (s["wall_time_s"] - t["eval"]) / s["steps"], **load}


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def aggregate(results: dict, keys: list, parts: list) -> dict:
    """Per row: digits accuracy (mean and per seed), bytes and ratio; per synthetic part, ratio and step time."""
    rows = {}
    for key in keys:
        r = {"label": ROWS[key][0], "engine": ROWS[key][1], "config": ROWS[key][2]}
        runs = [x for x in results.get("digits", {}).get(key, []) if x.get("status") == "ok"]
        if runs:
            r.update(accuracy=mean([x["accuracy"] for x in runs]), accuracies=[x["accuracy"] for x in runs],
                     wire_bytes=mean([x["wire_bytes"] for x in runs]), ratio=mean([x["ratio"] for x in runs]),
                     digits_step_s=mean([x["step_s"] for x in runs]), seeds_done=len(runs))
        for part in parts:
            if part == "digits":
                continue
            ok = [x for x in results.get(part, {}).get(key, []) if x.get("status") == "ok"]
            if ok:
                r[part] = {"ratio": ok[0]["ratio"], "step_s": ok[0]["step_s"],
                           "wire_bytes_per_step": ok[0]["wire_bytes"] / ok[0]["steps"],
                           "load": [ok[0].get("load_before"), ok[0].get("load_after")]}
        rows[key] = r
    return rows


def fmt(v, spec, suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def table(rows: dict, parts: list) -> str:
    head = ["method", "engine", "digits accuracy (mean)", "per seed", "digits ratio", "digits MB/worker"]
    for part in parts[1:] if parts[0] == "digits" else parts:
        head += [f"{part} ratio", f"{part} step s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows.values():
        cells = [r["label"], r["engine"], fmt(r.get("accuracy"), ".4f"),
                 " ".join(f"{a:.4f}" for a in r.get("accuracies", [])) or "-", fmt(r.get("ratio"), ".1f", "x"),
                 fmt(r["wire_bytes"] / 1e6 if r.get("wire_bytes") else None, ".3f")]
        for part in parts:
            if part != "digits":
                p = r.get(part, {})
                cells += [fmt(p.get("ratio"), ".1f", "x"), fmt(p.get("step_s"), ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: dict, path: Path) -> None:
    """Accuracy against bytes; rows at the same point share one label, and labels of points
    close to each other are stacked instead of drawn over each other."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points: dict = {}
    for r in rows.values():
        if r.get("accuracy") is not None:
            xy = (round(r["wire_bytes"] / 1e6, 3), round(100 * r["accuracy"], 2))
            points.setdefault(xy, []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    placed: list = []
    for (x, y), rs in sorted(points.items(), key=lambda p: (p[0][1], p[0][0])):
        ax.scatter(x, y, marker="s" if all(r["engine"] == "ddp" for r in rs) else "o")
        near = sum(1 for px, py in placed if abs(py - y) < 0.08 and 0.1 < px / x < 10)
        placed.append((x, y))
        ax.annotate(" = ".join(r["label"] for r in rs), (x, y), fontsize=7, xytext=(5, 3 + 10 * near),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per worker over the run (MB, log scale)")
    ax.set_ylabel("digits test accuracy, mean of seeds (%)")
    ax.set_title("digits CNN, 2 workers, 20 epochs: accuracy against bytes (squares: DDP)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", choices=list(ROWS), default=list(ROWS), metavar="KEY",
                    help=f"rows to run: {', '.join(ROWS)}")
    ap.add_argument("--parts", nargs="+", choices=["digits", *SYNTHETIC], default=["digits", *SYNTHETIC])
    ap.add_argument("--timed-steps", type=int, default=42, help="steps per synthetic timing run")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per launch before its session is killed")
    ap.add_argument("--runs", default=None, help="run folders (resumable; not for committing); default "
                    "runs/compare, or runs/compare-quick with --quick, so that a later full invocation does not "
                    "read a quick run's folder as done")
    ap.add_argument("--out", default=None, help="default: docs/results/<machine>-<date>/compare_baselines")
    ap.add_argument("--quick", action="store_true", help="one seed, 8 digits steps, small synthetic models")
    args = ap.parse_args(argv)
    if args.runs is None:
        args.runs = "runs/compare-quick" if args.quick else "runs/compare"
    if args.quick:
        args.seeds, args.timed_steps = args.seeds[:1], min(args.timed_steps, 3)
    if args.out is None:
        args.out = str(REPO / "docs/results" / f"{machine_name()}-{datetime.date.today()}" / "compare_baselines")
    return args


def write_outputs(out: Path, script: str, argv, text: str, results: dict, about: dict, loads: list,
                  t0: float) -> None:
    """A comparison's folder: table.md, results.json, the command that made it (command.txt) and
    the machine with the invocation's figures (machine.json); the table also to stdout."""
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    args = sys.argv[1:] if argv is None else argv
    (out / "command.txt").write_text("PYTHONPATH=$PWD python " + " ".join(shlex.quote(a) for a in [script, *args])
                                     + "\n")
    info = {**machine_info(), **about, "load_average_1min": {"min": min(loads), "max": max(loads)},
            "invocation_s": round(time.time() - t0)}
    (out / "machine.json").write_text(json.dumps(info, indent=1) + "\n")
    print(text)
    print(f"written: {out}")


def main(argv=None) -> int:
    """1. every (part, row, seed) not yet done, in that order; 2. aggregate; 3. table, plot, command, machine."""
    args = parse_args(argv)
    t0, loads = time.time(), [os.getloadavg()[0]]
    results: dict = {}
    for part in args.parts:                                                                    # 1.
        for key in args.only:
            seeds = args.seeds if part == "digits" else args.seeds[:1]
            results.setdefault(part, {})[key] = [run_one(args, part, key, s) for s in seeds]
            loads.append(os.getloadavg()[0])
    rows = aggregate(results, args.only, args.parts)                                           # 2.
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = table(rows, args.parts)                                                              # 3.
    write_outputs(out, "scripts/compare_baselines.py", argv, text, {"rows": rows, "runs": results},
                  {"seeds": args.seeds, "timed_steps": args.timed_steps, "quick": args.quick}, loads, t0)
    if "digits" in args.parts:
        plot(rows, out / "accuracy_vs_bytes.png")
    failed = [(p, k) for p, rs in results.items() for k, xs in rs.items() if any(x["status"] != "ok" for x in xs)]
    if failed:
        print(f"failed or timed out (rerun the same command to retry them): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
