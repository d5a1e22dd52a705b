"""Launch real `horovodrun` jobs from tests, with a hard timeout.

A hang in a collective must fail the test in seconds, not eat the CI budget:
the job runs in its own session, and on timeout every process of that session is
killed. Killing horovodrun's process group alone is not enough: mpirun puts the ranks
in process groups of their own, and a rank orphaned that way spun on a core for the
rest of a CI run.
"""
from __future__ import annotations

import functools
import json
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


def start(args: list, np: int = 2, env: dict | None = None, launcher_args: list | None = None,
          on: list = ()) -> subprocess.Popen:
    """Start ``horovodrun`` without waiting, for tests that act on a running job (signals);
    ``launcher_args`` replace ``-np N -H localhost:N``; ``on``: a prefix that runs it elsewhere
    (``ip netns exec ...``: an emulated host). Collect it with :func:`finish`."""
    cmd = [*on, *_command(launcher_args if launcher_args is not None else ["-np", np, "-H", f"localhost:{np}"],
                          args)]
    return subprocess.Popen(cmd, cwd=REPO, env=job_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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


def finish_timed(proc: subprocess.Popen, timeout: float = 180) -> tuple:
    """Like :func:`finish` (no exit-code check), but with the arrival time of every output
    line: (exit code, [(time.time(), line), ...])."""
    import threading
    import time
    lines: list = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        proc.wait()
        reader.join(5)
        raise AssertionError(f"job timed out after {timeout}s (hang?): {' '.join(map(str, proc.args))}\n"
                             + "".join(l for _, l in lines)[-4000:]) from None
    reader.join(30)
    return proc.returncode, lines


def _kill_session(sid: int) -> None:
    """SIGKILL every process of the launcher's session (from start_new_session), and its
    descendants in sessions of their own (the Gloo launcher starts each worker in one)."""
    for pid in _session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _session_processes(sid: int) -> list:
    """Pids of the processes whose session id is ``sid``, or whose ancestor is such a process."""
    parent, session = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # after "pid (comm)": state ppid pgrp session
            parent[int(entry)], session[int(entry)] = int(fields[1]), int(fields[3])
        except (OSError, ValueError, IndexError):
            continue
    ours = {pid for pid, s in session.items() if s == sid}
    for pid in parent:
        chain, p = [], pid
        while p in parent and p not in ours and p > 1 and len(chain) < 64:
            chain.append(p)
            p = parent[p]
        if p in ours:
            ours.update(chain)
    return sorted(ours)


def rank_pids(proc: subprocess.Popen, np: int, timeout: float = 120) -> dict:
    """{rank: pid} of the workers of a job from :func:`start` or :func:`start_torchrun`, by the rank
    variable each launcher gives its workers (mpirun: OMPI_COMM_WORLD_RANK, Gloo: HOROVOD_RANK,
    torchrun: RANK next to TORCHELASTIC_RUN_ID)."""
    import time
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = {}
        for pid in _session_processes(proc.pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    program = f.read().split(b"\0")[0]
            except OSError:
                continue
            rank = env.get(b"OMPI_COMM_WORLD_RANK", env.get(b"HOROVOD_RANK"))
            if rank is None and b"TORCHELASTIC_RUN_ID" in env:
                rank = env.get(b"RANK")
            if rank is not None and b"python" in program:
                found[int(rank)] = pid
        if len(found) == np:
            return found
        time.sleep(0.1)
    raise AssertionError(f"the job's {np} workers did not appear within {timeout}s")


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` installed (SigCgt in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


def run_script(name: str, *script_args, np: int = 2, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    """Run tests/mp/<name> under horovodrun."""
    return horovodrun(["python", str(REPO / "tests" / "mp" / name), *map(str, script_args)], np=np,
                      timeout=timeout, **kw)


@functools.cache
def _cases_job(name: str, cases: str, np: int, timeout: float) -> tuple:
    try:
        done = run_script("cases.py", name, cases, np=np, timeout=timeout, check=False)
    except AssertionError as hang:        # the timeout: kept, so the other cases fail at once
        return None, str(hang)
    return done.returncode, done.stdout


def case_output(name: str, cases: list, i: int, np: int = 2, timeout: float = 300) -> str:
    """The lines case ``i`` printed when tests/mp/<name>'s ``main`` ran every case of ``cases``
    in one horovodrun job (tests/mp/cases.py), without their tags. The job runs once per
    (name, cases, np): each launch costs two processes' start (torch, Horovod, MPI: about 10 s
    on the 2-core VM), which a parametrized test pays once, not once per case. Fails with the
    whole output where the job hung or exited with an error."""
    code, out = _cases_job(name, json.dumps(cases), np, timeout)
    assert code == 0, f"the job of {name}'s {len(cases)} cases failed (exit code {code}):\n{out[-6000:]}"
    tag = f"case {i}: "
    return "\n".join(line.split(tag, 1)[1] for line in out.splitlines() if tag in line)


def train_args(out_dir, config: str, *overrides: str, module: str = "redsync_hvd.train") -> list:
    return ["python", "-m", module, "--config", str(REPO / config), "--set", f"output.dir={out_dir}",
            "--set", "training.progress=false", *sum((["--set", o] for o in overrides), [])]


def train(out_dir, config: str, *overrides: str, np: int = 2, check: bool = True, timeout: float = 300,
          module: str = "redsync_hvd.train", launcher: str = "horovodrun") -> subprocess.CompletedProcess:
    """``python -m <module> --config <config> --set output.dir=<out_dir> --set k=v ...`` on N workers,
    under ``launcher``: horovodrun, torchrun, or python (one plain process, ``np`` ignored)."""
    args = train_args(out_dir, config, *overrides, module=module)[1:]   # without "python"
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


def start_torchrun(args: list, nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    """Start ``torchrun --standalone --nproc_per_node N <args>`` in a session of its own without
    waiting (as :func:`start` does for horovodrun); collect it with :func:`finish`."""
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", str(nproc), *map(str, args)]
    return subprocess.Popen(cmd, cwd=REPO, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of a job from :func:`start` or :func:`start_torchrun` at once (ranks
    in groups or sessions of their own included): a node that fails, the OOM killer."""
    _kill_session(proc.pid)


def plain(args: list, timeout: float = 120, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python <args>`` as one process, no launcher, with the same timeout and session kill."""
    return _run([sys.executable] + [str(a) for a in args], "python", timeout, env, check)


def job_env(env: dict | None = None) -> dict:
    """The environment :func:`start` gives horovodrun (and a shell script that runs it)."""
    return {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PYTHONPATH": str(REPO), "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            # a worker that crashes in native code prints every thread's Python stack
            "PYTHONFAULTHANDLER": "1",
            # more ranks than cores: let MPI yield instead of spinning while it waits
            "OMPI_MCA_mpi_yield_when_idle": "1", **(env or {})}


def _env(env: dict | None) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}


def _run(cmd: list, what: str, timeout: float, env: dict | None, check: bool) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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
