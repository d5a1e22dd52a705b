"""Starting multi-process jobs from the experiment tools: environment, command, hard timeout.

Every job runs in a session of its own (``start_new_session``) so that a timeout or a test can
kill all of it: mpirun puts its ranks in process groups of their own, and the Gloo launcher its
workers in sessions of their own, so killing the launcher's process group is not enough
(:func:`session_processes` follows the parent links as well).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: horovodrun (mpirun), horovodrun --gloo, torchrun --standalone
LAUNCHERS = ("horovodrun", "horovodrun-gloo", "torchrun")


def outside_mpi(env: dict) -> dict:
    """``env`` without what an MPI singleton (a caller that imported mpi4py) set for itself:
    with those, the mpirun under horovodrun takes itself for one of its ranks and exits 1
    without a word. A user's own OMPI_MCA_* settings stay."""
    if "PMIX_NAMESPACE" not in env:
        return env
    own = ("PMIX_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_APP_CTX_", "OMPI_COMM_WORLD_")
    return {k: v for k, v in env.items() if not k.startswith(own)}


def job_env(**extra: str) -> dict:
    """The environment every tool gives a horovodrun/torchrun job: this repository and its venv
    first, root allowed, TensorFlow quiet, no inherited MPI singleton; then ``extra``."""
    return {**outside_mpi(dict(os.environ)), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            **extra}


def command(launcher: str, np: int, program: list, launcher_args: list = ()) -> list:
    """``program`` (``["-m", module, ...]`` or ``[script, ...]``) on ``np`` local workers under
    ``launcher`` (one of :data:`LAUNCHERS`); ``launcher_args`` go to the launcher itself."""
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(np), *launcher_args,
                *map(str, program)]
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")
    gloo = ["--gloo"] if launcher == "horovodrun-gloo" else []
    return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", *gloo, *launcher_args,
            sys.executable, *map(str, program)]


def train_command(launcher: str, np: int, config, sets: list = (), module: str = "redsync_hvd.train",
                  args: list = (), launcher_args: list = ()) -> list:
    """``python -m <module> [args] --config <config> --set ...`` under ``launcher``. The runner
    under torchrun trains with ``engine: ddp`` (Horovod would not join torchrun's workers) unless
    ``sets`` choose its engine (``engine=fsdp``)."""
    chosen = any(str(s).startswith("engine=") for s in sets)
    torchrun_engine = launcher == "torchrun" and module == "redsync_hvd.train" and not chosen
    sets = list(sets) + (["engine=ddp"] if torchrun_engine else [])
    program = ["-m", module, *args, "--config", str(config), *[a for s in sets for a in ("--set", s)]]
    return command(launcher, np, program, launcher_args)


def session_processes(sid: int) -> dict:
    """{pid: (name, parent pid)} of the processes of session ``sid`` and every descendant of
    theirs, from /proc."""
    info = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                head, rest = f.read().rsplit(")", 1)   # "pid (comm) state ppid pgrp session ..."
            fields = rest.split()
            info[int(entry)] = (head.split("(", 1)[1], int(fields[1]), int(fields[3]))
        except (OSError, ValueError, IndexError):
            continue
    ours = {pid for pid, (_, _, session) in info.items() if session == sid}
    grew = True
    while grew:
        new = {pid for pid, (_, parent, _) in info.items() if parent in ours} - ours
        grew, ours = bool(new), ours | new
    return {pid: info[pid][:2] for pid in ours}


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a job started by :func:`start` or :func:`launch`)."""
    for pid in session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(cmd: list, log, env: dict | None = None) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own, its output appended to the open file ``log``."""
    log.write(" ".join(shlex.quote(str(c)) for c in cmd) + "\n")
    log.flush()
    return subprocess.Popen(cmd, cwd=REPO, env=env or job_env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def launch(cmd: list, log: Path, timeout: float, env: dict | None = None) -> str:
    """Run one job with a hard timeout, its output (after the command line) in ``log``.
    Returns "ok", "failed" or "timeout"."""
    env = env or job_env(OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = start(cmd, out, env)
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
