"""Launch real `horovodrun` jobs from tests, with a hard timeout.

A hang in a collective must fail the test in seconds, not eat the CI budget:
the job runs in its own session, and on timeout every process of that session is
killed. Killing horovodrun's process group alone is not enough: mpirun puts the ranks
in process groups of their own, and a rank orphaned that way spun on a core for the
rest of a CI run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def horovodrun(args: list, np: int = 2, timeout: float = 180, env: dict | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run ``horovodrun -np N -H localhost:N <args>`` (args after the launcher, e.g. ["python", "x.py"])."""
    cmd = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}"]
    cmd += [sys.executable if a == "python" else str(a) for a in args]
    full_env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PYTHONPATH": str(REPO), "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1",
                # more ranks than cores: let MPI yield instead of spinning while it waits
                "OMPI_MCA_mpi_yield_when_idle": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"horovodrun timed out after {timeout}s (hang?): {' '.join(cmd)}\n{out[-4000:]}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and proc.returncode != 0:
        raise AssertionError(f"horovodrun failed with exit code {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return result


def _kill_session(sid: int) -> None:
    """SIGKILL every process whose session id is ``sid`` (the launcher's, from start_new_session)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue   # gone meanwhile
        if int(fields[3]) == sid:   # after "pid (comm)": state ppid pgrp session ...
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_script(name: str, *script_args, np: int = 2, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    """Run tests/mp/<name> under horovodrun."""
    return horovodrun(["python", str(REPO / "tests" / "mp" / name), *map(str, script_args)], np=np,
                      timeout=timeout, **kw)


def train(out_dir, config: str, *overrides: str, np: int = 2, check: bool = True, timeout: float = 300,
          module: str = "redsync_hvd.train") -> subprocess.CompletedProcess:
    """``python -m <module> --config <config> --set output.dir=<out_dir> --set k=v ...`` on N workers."""
    args = ["python", "-m", module, "--config", str(REPO / config), "--set", f"output.dir={out_dir}",
            "--set", "training.progress=false", *sum((["--set", o] for o in overrides), [])]
    return horovodrun(args, np=np, check=check, timeout=timeout)


def summary(folder) -> dict:
    """A run folder's summary.json."""
    import json
    return json.loads((Path(folder) / "summary.json").read_text())
