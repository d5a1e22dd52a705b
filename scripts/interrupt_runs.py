"""Interrupt a run through its process group, resume it each time, and compare it with the same run
uninterrupted, bit for bit.

    python scripts/interrupt_runs.py [--launcher mpirun|gloo|torchrun] [--configs dense powersgd redsync sbc]
        [--signals SIGINT SIGTERM SIGKILL] [--set KEY=VALUE ...] [--seed 0] [--compare-at STEP]

For each config of ``configs/digits`` (by default ``make demo``'s four, 20 epochs): one run
straight to the end, and one that is started, sent each signal in turn to its launcher's
process group after a random 1 to 6 s of training (as Ctrl-C, ``kill -TERM -<pgid>`` and
``kill -KILL -<pgid>`` do), and resumed from its run folder each time (``--set
training.resume=<run>``) until it ends. Each interruption prints the steps of the checkpoints
it left (one step on every rank, or the newest step every rank holds); the last line per
config says whether weights, residuals and byte counters of every rank are those of the
uninterrupted run. ``--compare-at S`` compares the step-S copies instead of the last step
(both runs save every S steps and are stopped once they have): a long run, e.g. the
500-epoch digits run, need not be trained to its end twice.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from redsync_hvd import checkpoint
from redsync_hvd.experiments.jobs import start, train_command
from redsync_hvd.experiments.signals import LAUNCHER, signal_group, wait_for_end, wait_for_training


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launcher", choices=list(LAUNCHER), default="mpirun")
    ap.add_argument("--configs", nargs="+", default=["dense", "powersgd", "redsync", "sbc"])
    ap.add_argument("--signals", nargs="+", default=["SIGINT", "SIGTERM", "SIGKILL"])
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--seed", type=int, default=0, help="of the random moments")
    ap.add_argument("--compare-at", type=int, default=None, help="compare the step copies of this step")
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def launch(args, config: str, out: Path, name: str, *extra: str):
    every = [f"training.checkpoint_every={args.compare_at}"] if args.compare_at else []
    sets = [f"output.dir={out}", f"output.name={name}", "training.progress=false", *every, *args.overrides, *extra]
    return start(train_command(LAUNCHER[args.launcher], 2, f"configs/digits/{config}.yaml", sets),
                 open(out / f"{name}.log", "a"))


def to_the_end(args, proc, run: Path) -> int:
    """The launch trained to its end (0), or with ``--compare-at``: until both ranks saved that
    step's copy, then stopped with SIGTERM."""
    if not args.compare_at:
        return wait_for_end(proc)
    copies = [checkpoint.step_path(run, r, args.compare_at) for r in (0, 1)]
    while proc.poll() is None and not all(c.exists() for c in copies):
        time.sleep(0.2)
    if proc.poll() is None:
        wait_for_end(proc, signal_group(proc, "SIGTERM"))
    return 0 if all(c.exists() for c in copies) else 1


def interrupted(args, config: str, out: Path, rng: random.Random) -> list:
    """The run, interrupted by every signal in turn and resumed; [(signal, steps of the checkpoints)]."""
    run, lines = out / "run", []
    for name in args.signals:
        # no checkpoint yet (a SIGKILL before the first save): start that run again
        resume = (f"training.resume={run}",) if (run / "checkpoint-rank0.pt").exists() else ("output.overwrite=true",)
        proc = launch(args, config, out, "run", *resume)
        wait_for_training(proc)
        time.sleep(rng.uniform(1.0, 6.0))
        if proc.poll() is not None:
            raise SystemExit(f"{config}: the run ended before the {name}; give it more steps "
                             "(--set training.epochs=...)")
        code = wait_for_end(proc, signal_group(proc, name))
        steps = [checkpoint.load(run, r)["step"] for r in (0, 1)]
        lines.append((name, steps, code))
    if to_the_end(args, launch(args, config, out, "run", f"training.resume={run}"), run) != 0:
        raise SystemExit(f"{config}: the final resume failed; see {out / 'run.log'}")
    return lines


def same(ref: Path, run: Path, step: int | None) -> str:
    """'bit-identical' or what differs, over both ranks' final checkpoints (or step copies)."""
    for rank in (0, 1):
        if step is None:
            a, b = checkpoint.load(ref, rank), checkpoint.load(run, rank)
        else:
            a, b = (checkpoint.load(checkpoint.step_path(f, rank, step), rank) for f in (ref, run))
        if a["step"] != b["step"] or any(not torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
            return f"weights of rank {rank} differ"
        ea, eb = checkpoint.exchange_state(a), checkpoint.exchange_state(b)
        if ea is None:
            continue
        ra, rb = (e.get("memory", {}).get("residual", {}) for e in (ea, eb))
        if ra.keys() != rb.keys() or any(not torch.equal(ra[k], rb[k]) for k in ra):
            return f"residuals of rank {rank} differ"
        counters = [{k: v for k, v in e["stats"]["total"].items() if not k.startswith("time_")} for e in (ea, eb)]
        if counters[0] != counters[1]:
            return f"byte counters of rank {rank} differ"
    return "bit-identical (weights, residuals, byte counters of both ranks)"


def main(argv=None) -> int:
    args = parse(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="interrupt-runs-"))
    rng = random.Random(args.seed)
    print(f"{args.launcher}, signals to the launcher's process group: {' '.join(args.signals)}; "
          f"seed {args.seed}; {root}")
    for config in args.configs:
        out = root / config
        out.mkdir(parents=True, exist_ok=True)
        if to_the_end(args, launch(args, config, out, "ref", "output.overwrite=true"), out / "ref") != 0:
            raise SystemExit(f"{config}: the uninterrupted run failed; see {out / 'ref.log'}")
        for name, steps, code in interrupted(args, config, out, rng):
            print(f"  {config:9s} {name:8s} exit {code:4d}  checkpoints of steps {steps}"
                  f"{' (one step)' if len(set(steps)) == 1 else ''}")
        where = f"step {args.compare_at}" if args.compare_at else "the end"
        print(f"  {config:9s} resumed, at {where}: {same(out / 'ref', out / 'run', args.compare_at)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
