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
    return finish(start(args, np=np, env=env), timeout=timeout, check=check)


def _command(launcher_args: list, args: list) -> list:
    return [str(BIN / "horovodrun"), *map(str, launcher_args)] + \
        [sys.executable if a == "python" else str(a) for a in args]


def start(args: list, np: int = 2, env: dict | None = None, launcher_args: list | None = None) -> subprocess.Popen:
    """Start ``horovodrun`` without waiting, for tests that act on a running job (signals);
    ``launcher_args`` replace ``-np N -H localhost:N``. Collect it with :func:`finish`."""
    cmd = _command(launcher_args if launcher_args is not None else ["-np", np, "-H", f"localhost:{np}"], args)
    full_env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                "PYTHONPATH": str(REPO), "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1",
                # more ranks than cores: let MPI yield instead of spinning while it waits
                "OMPI_MCA_mpi_yield_when_idle": "1", **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
    """Wait for a job from :func:`start`; on timeout kill its whole session and fail."""
    cmd = proc.args
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"horovodrun timed out after {timeout}s (hang?): {' '.join(cmd)}\n{out[-4000:]}") from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and proc.returncode != 0:
        raise AssertionError(f"horovodrun failed with exit code {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return result


def horovodrun_elastic(args: list, min_np: int, max_np: int, discovery_script, np: int | None = None,
                       timeout: float = 180, env: dict | None = None, check: bool = True,
                       launcher_args: list = ()) -> subprocess.CompletedProcess:
    """``horovodrun -np N --min-np --max-np --host-discovery-script <script> <args>`` (Gloo,
    elastic; N defaults to ``max_np``)."""
    launcher = ["-np", np or max_np, "--min-np", min_np, "--max-np", max_np, "--host-discovery-script",
                discovery_script, *launcher_args]
    return finish(start(args, env=env, launcher_args=launcher), timeout=timeout, check=check)


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
          module: str = "redsync_hvd.train", launcher: str = "horovodrun") -> subprocess.CompletedProcess:
    """``python -m <module> --config <config> --set output.dir=<out_dir> --set k=v ...`` on N workers,
    under ``launcher``: horovodrun, torchrun, or python (one plain process, ``np`` ignored)."""
    args = ["-m", module, "--config", str(REPO / config), "--set", f"output.dir={out_dir}",
            "--set", "training.progress=false", *sum((["--set", o] for o in overrides), [])]
    if launcher == "torchrun":
        return torchrun(args, nproc=np, check=check, timeout=timeout)
    if launcher == "python":
        return plain(args, check=check, timeout=timeout)
    return horovodrun(["python", *args], np=np, check=check, timeout=timeout)


def summary(folder) -> dict:
    """A run folder's summary.json."""
    import json
    return json.loads((Path(folder) / "summary.json").read_text())


def torchrun(args: list, nproc: int = 2, timeout: float = 120, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node N <args>`` (args: a script and its arguments,
    or ["-m", module, ...]) with the same hard timeout and session kill as :func:`horovodrun`."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc)]
    return _run(cmd + [str(a) for a in args], "torchrun", timeout, env, check)


def plain(args: list, timeout: float = 120, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python <args>`` as one process, no launcher, with the same timeout and session kill."""
    return _run([sys.executable] + [str(a) for a in args], "python", timeout, env, check)


def _run(cmd: list, what: str, timeout: float, env: dict | None, check: bool) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} timed out after {timeout}s (hang?): {' '.join(cmd)}\n{out[-4000:]}") from None
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, "")
    if check and proc.returncode != 0:
        raise AssertionError(f"{what} failed with exit code {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return result


def run_torch_script(name: str, *script_args, nproc: int = 2, timeout: float = 120,
                     **kw) -> subprocess.CompletedProcess:
    """Run tests/mp/<name> under torchrun."""
    return torchrun([REPO / "tests" / "mp" / name, *script_args], nproc=nproc, timeout=timeout, **kw)
