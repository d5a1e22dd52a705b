"""Start one MPI rank per emulated host: ``mpirun`` with an rsh agent that enters namespaces.

The decentralized methods (DCD/ECD) are launched with one MPI world across the hosts, so
that mpi4py's transport works too; Horovod then runs on MPI (its controller is MPI when
the job is started by ``mpirun``) and carries their messages by default. ``mpirun`` itself runs in the
switch namespace, and starts its daemon on each host through ``plm_rsh_agent``: a small
script that, instead of ssh, runs the daemon's command line under
``ip netns exec <that host's namespace>``. Options that keep every byte on the shaped links:

* ``btl tcp,self``: no shared-memory transport. Namespaces share /dev/shm, so Open MPI's
  ``vader`` would connect the "hosts" through memory and bypass the network.
* ``btl_tcp_if_include`` / ``oob_tcp_if_include`` = the hosts' subnet.
* ``mpi_yield_when_idle 1``: the emulated hosts share this machine's cores, which Open MPI
  cannot see (each host has one slot), so by default every rank's progress loop spins on a core
  while it waits. That took the cores the other rank computes and sends on: VGG-FC's forward and
  backward took twice Gloo's launch's under mpirun, and dense over MPI moved 1.7x between
  launches. Yielding is Open MPI's own mode for oversubscribed nodes.

Needs Open MPI (Debian's ``openmpi-bin``, as Horovod's MPI build). The whole job, daemons
included, is one process group killed at the deadline; nothing outlives :func:`launch_mpi`.
"""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

from .launcher import REPO, LaunchError, WorkerResult

_AGENT = """#!/bin/sh
# rsh agent for mpirun (written by redsync_hvd/experiments/netbench/mpi_launcher.py): $1 is a host address,
# the rest its command line; run it inside that host's network namespace instead of over ssh
host="$1"; shift
ns=$(awk -v h="$host" '$1 == h {{print $2}}' "{map}")
[ -n "$ns" ] || {{ echo "netbench rsh agent: no namespace for host $host" >&2; exit 1; }}
exec ip netns exec "$ns" sh -c "$*"
"""


def mpirun_missing() -> str | None:
    """Why MPI jobs cannot start here, or None."""
    if shutil.which("mpirun") is None:
        return "mpirun is not installed (Debian: apt-get install openmpi-bin libopenmpi-dev)"
    return None


def launch_mpi(net, command: list, timeout: float = 600, log_dir: str | Path | None = None,
               env: dict | None = None, check: bool = True) -> list[WorkerResult]:
    """Run ``command`` as one MPI rank per host of ``net`` (rank i on host i).

    ``command``: argv; the token ``python`` becomes this interpreter. ``env``: extra
    variables every rank gets. With ``check``, a failure or the deadline raises
    :class:`LaunchError` with the tail of the job's log."""
    why = mpirun_missing()
    if why:
        raise LaunchError(why)
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="netbench-mpi-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    hostmap = log_dir / "hosts.map"
    hostmap.write_text("".join(f"{net.host_addr(i)} {net.host_ns(i)}\n" for i in range(net.hosts)))
    agent = log_dir / "rsh-agent.sh"
    agent.write_text(_AGENT.format(map=hostmap))
    agent.chmod(agent.stat().st_mode | stat.S_IXUSR)
    extra = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in (env or {}).items()}}
    argv = [sys.executable if c == "python" else str(c) for c in command]
    cmd = _mpirun_argv(net, agent, extra) + argv
    log = log_dir / "mpirun.log"
    run_env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=run_env,
                             start_new_session=True)
        try:
            p.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for i in range(net.hosts):   # the daemons run in the hosts' namespaces: nothing may stay
        for pid in subprocess.run(["ip", "netns", "pids", net.host_ns(i)], capture_output=True,
                                  text=True).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    results = [WorkerResult(i, i, p.returncode, log) for i in range(net.hosts)]
    if check and (timed_out or p.returncode != 0):
        why = f"timed out after {timeout:.0f}s" if timed_out else f"mpirun exited with {p.returncode}"
        raise LaunchError(f"{why} ({net.describe()}); log {log}\n{log.read_text()[-3000:]}")
    return results


def _mpirun_argv(net, agent: Path, extra: dict) -> list:
    """mpirun's command line, in the switch namespace: one rank per host, TCP on the hosts' subnet
    only, ``extra`` exported to every rank."""
    subnet = net.host_addr(0).rsplit(".", 1)[0] + ".0/24"
    cmd = net.exec_prefix(None) + [
        "mpirun", "-np", str(net.hosts), "--host", ",".join(f"{net.host_addr(i)}:1" for i in range(net.hosts)),
        "--mca", "plm_rsh_agent", str(agent), "--mca", "btl", "tcp,self",
        "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
        # mpirun shares its hwloc topology with the daemons through shared memory mapped at a
        # hole it finds in its own address space; a daemon whose /sys is the namespace's own
        # (``ip netns exec`` remounts it) can crash adopting it, so each daemon reads its own
        "--mca", "rtc_hwloc_vmhole", "none",
        "--mca", "mpi_yield_when_idle", "1",
        "--tag-output", "--bind-to", "none"]
    for k, v in extra.items():
        cmd += ["-x", f"{k}={v}"]
    return cmd
