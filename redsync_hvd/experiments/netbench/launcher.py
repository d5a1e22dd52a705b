"""Start one Horovod (Gloo) worker per emulated host, without ssh and without horovodrun.

What ``horovodrun --gloo -np N -H a:1,b:1`` does, done by hand (see
``horovod/runner/gloo_run.py``): a rendezvous server (``rendezvous.py``) runs in the
switch namespace at the bridge address; each worker is started with
``ip netns exec <host ns> <command>`` and the environment gloo_run would give it:

* per slot (``create_slot_env_vars``): HOROVOD_HOSTNAME, HOROVOD_RANK, HOROVOD_SIZE,
  HOROVOD_LOCAL_RANK, HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE;
* per run (``create_run_env_vars``): HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT,
  HOROVOD_CONTROLLER=gloo, HOROVOD_CPU_OPERATIONS=gloo, HOROVOD_GLOO_IFACE=eth0 (the
  host's only link, so every byte between workers crosses the shaped veth).

Every worker runs in its own process group with its output in ``log_dir``; if one
fails, the others are stopped after a short grace; everything is killed at the
deadline. Nothing outlives :func:`launch`.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..jobs import REPO
from .rendezvous import slot_plan


@dataclass
class WorkerResult:
    rank: int
    host: int
    returncode: int | None
    log: Path

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class LaunchError(RuntimeError):
    pass


def _kill_group(p: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)   # the group the worker leads (start_new_session): ours
        except ProcessLookupError:
            pass


def _stop(procs, grace: float = 5.0) -> None:
    for p in procs:
        _kill_group(p, signal.SIGTERM)
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            _kill_group(p, signal.SIGKILL)
            p.wait(timeout=10)


def worker_env(net, slot, port: int, extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({
        # create_slot_env_vars
        "HOROVOD_HOSTNAME": str(slot.hostname), "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        # create_run_env_vars
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": net.switch_addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": net.iface,
        "PYTHONPATH": os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        "PYTHONUNBUFFERED": "1",
    })
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def _wait(procs, deadline: float) -> bool:
    """Until every worker ended, 10 s after the first failure, or the deadline; True if that passed."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.time()     # the others would block in a collective: give them a moment
        if failed_at is not None and time.time() - failed_at > 10:
            break
        if time.time() > deadline:
            break
        time.sleep(0.05)
    return any(p.poll() is None for p in procs) and time.time() > deadline


def launch(net, command: list, timeout: float = 600, log_dir: str | Path | None = None,
           env: dict | None = None, slots_per_host: int = 1, check: bool = True) -> list[WorkerResult]:
    """Run ``command`` once per slot of ``net``'s hosts as one Horovod job; return per-rank results.

    ``command`` is an argv list; the token ``python`` is replaced by this interpreter
    (the venv's). With ``check``, a non-zero exit or the deadline raises
    :class:`LaunchError` carrying the failing workers' log tails.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="netbench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    hosts = ",".join(f"{net.host_addr(i)}:{slots_per_host}" for i in range(net.hosts))
    plan = slot_plan(hosts)
    host_of = {net.host_addr(i): i for i in range(net.hosts)}
    argv = [sys.executable if c == "python" else str(c) for c in command]
    server = [sys.executable, "-m", f"{__package__}.rendezvous", "--hosts", hosts]
    rdv = subprocess.Popen(net.exec_prefix(None) + server,
                           cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=open(log_dir / "rendezvous.log", "w"), text=True, start_new_session=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    procs, results, files = [], [], []
    deadline = time.time() + timeout
    try:
        ready, _, _ = select.select([rdv.stdout], [], [], min(120.0, timeout))
        line = rdv.stdout.readline().strip() if ready else ""
        if not line.startswith("PORT "):
            raise LaunchError(f"rendezvous server did not start: {(log_dir / 'rendezvous.log').read_text()[-2000:]}")
        port = int(line.split()[1])
        for slot in plan:
            log = log_dir / f"worker-rank{slot.rank}.log"
            f = open(log, "w")
            files.append(f)
            i = host_of[slot.hostname]
            procs.append(subprocess.Popen(net.exec_prefix(i) + argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                          env=worker_env(net, slot, port, env), start_new_session=True))
            results.append(WorkerResult(slot.rank, i, None, log))
        timed_out = _wait(procs, deadline)
    finally:
        _stop(procs)
        for f in files:
            f.close()
        if rdv.poll() is None:
            try:
                rdv.stdin.close()
                rdv.wait(timeout=5)
            except (subprocess.TimeoutExpired, OSError):
                _kill_group(rdv, signal.SIGKILL)
                rdv.wait(timeout=10)
    for r, p in zip(results, procs):
        r.returncode = p.returncode
    if check and (timed_out or any(r.returncode != 0 for r in results)):
        why = f"timed out after {timeout:.0f}s" if timed_out else "a worker failed"
        bad = [r for r in results if r.returncode != 0] or results
        raise LaunchError(f"{why} ({net.describe()}); logs in {log_dir}\n" + "\n".join(
            f"--- rank {r.rank} (host {r.host}) exit {r.returncode}:\n{r.tail(3000)}" for r in bad[:2]))
    return results
