"""Where the time goes when a running job is interrupted: from the signal to every rank's checkpoint.

    python scripts/stop_timeline.py [--launcher mpirun|gloo|torchrun] [--signal SIGINT|SIGTERM]
        [--after 3] [--relay on|off] [--mpi-args "..."] [--config configs/digits/redsync.yaml] [--set KEY=VALUE ...]

Starts a 2-worker run (the digits CNN for 500 epochs by default) the way a terminal starts a job,
in a process group of its own, under ``horovodrun`` (mpirun, the default launch),
``horovodrun --gloo`` or ``torchrun`` (``engine: ddp``). Once both ranks train (their SIGTERM
handlers are in place), it waits ``--after`` seconds and sends the signal to the job's process
group, as Ctrl-C (SIGINT) or ``kill -TERM -<pgid>`` do. Then it prints, in seconds after the
signal: when each rank heard a signal, agreed on the stop and finished its save (the stop record
in the run folder's metrics.jsonl), when each process of the job ended, the steps of the
checkpoints left and the launcher's exit code. ``--relay off`` sets ``REDSYNC_RELAY=0``: mpirun's
ranks then hear only mpirun's own SIGTERM (redsync_hvd/launchers.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from redsync_hvd.experiments.jobs import job_env, start, train_command
from redsync_hvd.experiments.machine import cpu_name
from redsync_hvd.experiments.signals import LAUNCHER, signal_group, wait_for_training, watch_ends


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launcher", choices=list(LAUNCHER), default="mpirun")
    ap.add_argument("--signal", choices=["SIGINT", "SIGTERM"], default="SIGINT")
    ap.add_argument("--after", type=float, default=3.0, help="seconds of training before the signal")
    ap.add_argument("--relay", choices=["on", "off"], default="on")
    ap.add_argument("--mpi-args", default=None,
                    help="horovodrun's --mpi-args, e.g. \"--mca odls_base_sigkill_timeout 30\"")
    ap.add_argument("--config", default="configs/digits/redsync.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=["training.epochs=500"])
    ap.add_argument("--out", default=None, help="run folder root (default: a temporary folder)")
    return ap.parse_args(argv)


def stop_events(run: Path, t0: float) -> list:
    """[(seconds after t0, event)] from the stop record rank 0 wrote to metrics.jsonl."""
    path = run / "metrics.jsonl"
    records = [json.loads(l) for l in path.read_text().splitlines() if '"stopped"' in l] if path.exists() else []
    if not records:
        return [(float("nan"), "no stop record: the ranks were killed before they wrote it")]
    r, events = records[-1], []
    for rank, (heard, agreed, saved, save_s) in enumerate(zip(r["heard_at"], r["agreed_at"], r["saved_at"],
                                                               r["save_s"])):
        if heard is not None:
            events.append((heard - t0, f"rank {rank} heard {r['reason']}"))
        events.append((agreed - t0, f"rank {rank} agreed to stop after step {r['step']}"))
        events.append((saved - t0, f"rank {rank} saved ({save_s:.3f} s)"))
    return events


def main(argv=None) -> int:
    args = parse(argv)
    out = args.out or tempfile.mkdtemp(prefix="stop-timeline-")
    Path(out).mkdir(parents=True, exist_ok=True)
    env = job_env(**({"REDSYNC_RELAY": "0"} if args.relay == "off" else {}))
    mpi = [f"--mpi-args={args.mpi_args}"] if args.mpi_args and args.launcher != "torchrun" else []
    sets = [f"output.dir={out}", "output.overwrite=true", *args.overrides]   # each timeline a run of its own
    cmd = train_command(LAUNCHER[args.launcher], 2, args.config, sets, launcher_args=mpi)
    with open(Path(out) / "launcher.log", "w") as log:
        proc = start(cmd, log, env)
        wait_for_training(proc)
        time.sleep(args.after)
        t0 = time.time()
        signal_group(proc, args.signal)
        ends = watch_ends(proc, t0)
    run = Path(out) / Path(args.config).stem
    relay = f", relay {args.relay}" if args.launcher == "mpirun" else ""
    print(f"{' '.join(cmd[:6])} ... ({args.launcher}{relay}): {args.signal} to its process group "
          f"at t = 0 (machine: {cpu_name()}, load {os.getloadavg()[0]:.1f})")
    for t, what in sorted(stop_events(run, t0) + ends):
        print(f"  {t:+8.3f} s  {what}")
    steps = [torch.load(p, weights_only=True)["step"] for p in sorted(run.glob("checkpoint-rank*.pt"))]
    hint = "continue with --set training.resume=" in (Path(out) / "launcher.log").read_text(errors="replace")
    print(f"checkpoints: steps {steps}{' (one step)' if len(set(steps)) == 1 and len(steps) == 2 else ''}; "
          f"resume hint printed: {'yes' if hint else 'no'}; run folder {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
