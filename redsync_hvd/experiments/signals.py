"""A running job seen from outside, for the tools that signal it (``scripts/stop_timeline.py``,
``scripts/interrupt_runs.py``): which process is which rank, when the ranks train, when each
process ended. Everything is read from /proc."""
from __future__ import annotations

import os
import signal
import time

from .jobs import session_processes

#: the launcher names of the signal tools, as jobs.LAUNCHERS spells them
LAUNCHER = {"mpirun": "horovodrun", "gloo": "horovodrun-gloo", "torchrun": "torchrun"}


def rank_of(pid: int) -> int | None:
    """The rank of a ``redsync_hvd.train`` worker, by the variable its launcher gave it
    (mpirun: OMPI_COMM_WORLD_RANK, Gloo: HOROVOD_RANK, torchrun: RANK beside TORCHELASTIC_RUN_ID)."""
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
    """Whether ``pid`` has a SIGTERM handler installed (SigCgt): the runner's, once it trains."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def wait_for_training(proc, ranks: int = 2, timeout: float = 300) -> dict:
    """{rank: pid} once every rank of the job ``proc`` leads has its SIGTERM handler installed."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = {r: pid for pid in session_processes(proc.pid) if (r := rank_of(pid)) is not None}
        if len(found) == ranks and all(catches_sigterm(pid) for pid in found.values()):
            return found
        time.sleep(0.1)
    raise SystemExit(f"the job did not start training within {timeout} s (exit code {proc.poll()})")


def ended(pid: int) -> bool:
    """Gone, or a zombie (ended, not yet collected by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_for_end(proc, job=(), timeout: float = 900) -> int:
    """The launcher's exit code, once it and every process of ``job`` ended (pids taken before a
    signal: ranks that outlive a killed launcher are no longer its descendants)."""
    deadline = time.time() + timeout

    def alive() -> bool:
        return proc.poll() is None or any(not ended(pid) for pid in job)
    while time.time() < deadline and alive():
        time.sleep(0.05)
    if alive():
        raise SystemExit(f"the job did not end within {timeout} s")
    return proc.returncode


def watch_ends(proc, t0: float, timeout: float = 120) -> list:
    """[(seconds after t0, what ended)] for every process of the job, until the launcher has ended."""
    alive, ends = session_processes(proc.pid), []
    names = {pid: f"{name}[{pid}]" for pid, (name, _) in alive.items()}
    while alive and time.time() < t0 + timeout:
        for pid in [p for p in alive if ended(p)]:
            ends.append((time.time() - t0, f"{names[pid]} ended"))
            del alive[pid]
        if proc.poll() is not None and not alive:
            break
        time.sleep(0.002)
    proc.wait(timeout=30)
    ends.append((time.time() - t0, f"launcher ended, exit code {proc.returncode}"))
    return ends


def signal_group(proc, name: str) -> set:
    """Send signal ``name`` to the job's process group, as Ctrl-C or ``kill -<SIG> -<pgid>`` do;
    returns the job's pids from just before it."""
    job = set(session_processes(proc.pid))
    os.killpg(proc.pid, getattr(signal, name))
    return job
