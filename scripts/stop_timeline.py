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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_baselines import BIN, REPO, job_env  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launcher", choices=["mpirun", "gloo", "torchrun"], default="mpirun")
    ap.add_argument("--signal", choices=["SIGINT", "SIGTERM"], default="SIGINT")
    ap.add_argument("--after", type=float, default=3.0, help="seconds of training before the signal")
    ap.add_argument("--relay", choices=["on", "off"], default="on")
    ap.add_argument("--mpi-args", default=None,
                    help="horovodrun's --mpi-args, e.g. \"--mca odls_base_sigkill_timeout 30\"")
    ap.add_argument("--config", default="configs/digits/redsync.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=["training.epochs=500"])
    ap.add_argument("--out", default=None, help="run folder root (default: a temporary folder)")
    return ap.parse_args(argv)


def command(args, out: str) -> list:
    train = ["-m", "redsync_hvd.train", "--config", args.config, "--set", f"output.dir={out}",
             "--set", "output.overwrite=true",   # each timeline a run of its own, also in a given --out
             *sum((["--set", o] for o in args.overrides), [])]
    if args.launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", *train, "--set", "engine=ddp"]
    gloo = ["--gloo"] if args.launcher == "gloo" else []
    mpi = [f"--mpi-args={args.mpi_args}"] if args.mpi_args else []
    return [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", *gloo, *mpi, sys.executable, *train]


# -- the job's processes, from /proc ---------------------------------------------------------------
def processes(sid: int) -> dict:
    """{pid: (name, parent)} of the session ``sid`` and everything started from it."""
    info = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
                fields = rest.split()
                info[int(entry)] = (head.split("(", 1)[1], int(fields[1]), int(fields[3]))
            except (OSError, ValueError, IndexError):
                continue
    ours = {pid for pid, (_, _, s) in info.items() if s == sid}
    grew = True
    while grew:
        new = {pid for pid, (_, parent, _) in info.items() if parent in ours} - ours
        grew, ours = bool(new), ours | new
    return {pid: info[pid][:2] for pid in ours}


def rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"redsync_hvd.train" not in f.read():
                return None
    except OSError:
        return None
    rank = env.get(b"OMPI_COMM_WORLD_RANK", env.get(b"HOROVOD_RANK"))
    if rank is None and b"TORCHELASTIC_RUN_ID" in env:
        rank = env.get(b"RANK")
    return None if rank is None else int(rank)


def catches_sigterm(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def wait_for_training(proc, timeout: float = 300) -> dict:
    """{rank: pid} once both ranks have their SIGTERM handlers installed."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        ranks = {r: pid for pid in processes(proc.pid) if (r := rank_of(pid)) is not None}
        if len(ranks) == 2 and all(catches_sigterm(pid) for pid in ranks.values()):
            return ranks
        time.sleep(0.1)
    raise SystemExit(f"the job did not start training within {timeout} s (exit code {proc.poll()})")


def watch_ends(proc, t0: float, timeout: float = 120) -> list:
    """[(seconds after t0, what ended)] for every process of the job, until the launcher has ended."""
    alive, ends = processes(proc.pid), []
    names = {pid: f"{name}[{pid}]" for pid, (name, _) in alive.items()}
    while alive and time.time() < t0 + timeout:
        for pid in list(alive):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    gone = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                gone = True
            if gone:
                ends.append((time.time() - t0, f"{names[pid]} ended"))
                del alive[pid]
        if proc.poll() is not None and not alive:
            break
        time.sleep(0.002)
    proc.wait(timeout=30)
    ends.append((time.time() - t0, f"launcher ended, exit code {proc.returncode}"))
    return ends


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
    cmd = command(args, out)
    with open(Path(out) / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for_training(proc)
        time.sleep(args.after)
        t0 = time.time()
        os.killpg(proc.pid, getattr(signal, args.signal))
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


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
