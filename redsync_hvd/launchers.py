"""What each launcher does when its job is interrupted, and how a rank hears of it in time.

Ctrl-C sends SIGINT to the terminal's foreground process group, and a scheduler or a shell
(``kill -TERM -<pgid>``) signals the job's process group. What reaches the ranks, and how
long they have before the launcher kills them (measured with ``scripts/stop_timeline.py``):

    launcher              ranks hear                               then SIGKILL after
    horovodrun (mpirun)   nothing: each rank leads a process group   mpirun, on SIGINT or SIGTERM:
                          of its own, outside the terminal's         SIGCONT, T s, SIGTERM, T s,
                                                                     SIGKILL (T: odls_base_sigkill_timeout, 1)
    horovodrun --gloo     SIGTERM from its wrapper, at once          5 s (GRACEFUL_TERMINATION_TIME_S)
    torchrun              the same signal, at once                   30 s

Under mpirun a rank would hear of the stop only from mpirun's SIGTERM, 1 s after the signal
and 1 s before the SIGKILL. :func:`start_relay` gives each such rank a small process in the
launcher's process group that passes SIGINT and SIGTERM on to the rank at once: the rank
then has 2 T from the signal (its step, the agreement, its save and its exit; digits CNN on
the 2-core test machine: well under 1 s). :func:`stop_window` is that time per launcher,
which the runner compares with what a stop of its run takes (:func:`window_note`).

This module imports nothing outside the standard library: ``python -I -S launchers.py`` is
the relay process (``relay``), started before anything heavy is imported.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

RELAYED = (signal.SIGINT, signal.SIGTERM)
GLOO_GRACE_S = 5.0       # horovod.runner.common.util.safe_shell_exec.GRACEFUL_TERMINATION_TIME_S
TORCHRUN_GRACE_S = 30.0  # torch.distributed.elastic's shutdown timeout
# what a run whose stop does not fit should use instead, per launcher
MORE_TIME = {
    "mpirun": "horovodrun --mpi-args=\"--mca odls_base_sigkill_timeout 30\" ... (60 s; mpirun then also "
              "takes that long to return after a stop)",
    "gloo": "torchrun --nproc_per_node N -m redsync_hvd.train ... --set engine=ddp (30 s), or horovodrun "
            "--mpi-args=\"--mca odls_base_sigkill_timeout 30\" (60 s)",
    "torchrun": "a shorter step (smaller batch or model): torchrun's 30 s are fixed",
}


def kind(environ=os.environ) -> str | None:
    """"mpirun" (horovodrun's default, or Open MPI's mpirun itself), "gloo" (horovodrun --gloo),
    "torchrun", or None (a plain process, or a launcher not listed here, e.g. Slurm's srun), from
    the variables each launcher gives its workers before they start."""
    if "TORCHELASTIC_RUN_ID" in environ:
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return "mpirun"
    if "HOROVOD_RANK" in environ:
        return "gloo"
    return None


def sigkill_timeout(environ=os.environ) -> float:
    """Open MPI's ``odls_base_sigkill_timeout`` as mpirun passes it to its ranks (default 1 s)."""
    try:
        return float(environ.get("OMPI_MCA_odls_base_sigkill_timeout", 1))
    except ValueError:
        return 1.0


def stop_window(environ=os.environ, relayed: bool = True) -> float | None:
    """Seconds from the signal to the launcher's SIGKILL, as a rank of this launcher sees them
    (``relayed``: this mpirun rank hears the signal at once through :func:`start_relay`);
    None: no launcher kills this process."""
    launcher = kind(environ)
    if launcher == "mpirun":
        return sigkill_timeout(environ) * (2 if relayed else 1)
    return {"gloo": GLOO_GRACE_S, "torchrun": TORCHRUN_GRACE_S}.get(launcher)


def window_note(environ, step_s: float, save_s: float, relayed: bool = True) -> str | None:
    """One line when a stop of this run may not fit in its launcher's window, else None.

    A stop finishes the step in progress, carries the flags in the next step's allreduce,
    saves and exits: about two steps and a save. Half the window is kept for a loaded machine."""
    window = stop_window(environ, relayed)
    need = 2 * step_s + save_s
    if window is None or need <= window / 2:
        return None
    launcher = kind(environ)
    return (f"note: {launcher} kills a job's ranks {window:g} s after Ctrl-C or SIGTERM; a stop of this run needs "
            f"about {need:.1f} s (steps of {step_s:.2f} s, a save of {save_s:.2f} s), so it may lose the checkpoint. "
            f"Safe: {MORE_TIME[launcher]}")


# -- a rank's own start and end -----------------------------------------------------------------
# the global rank, as each launcher gives it to its workers before they start
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMIX_RANK", "PMI_RANK")
_startup: dict = {}


def rank(environ=os.environ) -> int | None:
    """This worker's global rank from its launcher's variables (torchrun: RANK), or None (a plain
    process): what decides, before any framework starts, which rank prints a shared error."""
    names = ("RANK",) if "TORCHELASTIC_RUN_ID" in environ else _RANK_VARS
    for name in names:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


def says(environ=os.environ) -> bool:
    """Whether this process prints what every rank would print alike: rank 0, or a plain process."""
    return rank(environ) in (None, 0)


def guard_startup(environ=os.environ) -> None:
    """Until :func:`end_startup_guard` (the training loop's own handlers take over): Ctrl-C or
    SIGTERM ends this process at once with one line from rank 0 and exit code 128 + signal,
    instead of a KeyboardInterrupt traceback from whatever import or collective it was in.
    Nothing is lost: no step has been trained yet."""
    def interrupted(signum, frame):
        if says(environ):
            line = (f"interrupted ({signal.Signals(signum).name}) while starting, before the first step: nothing was "
                    "trained or saved\n")
            try:
                os.write(2, line.encode())
            except OSError:
                pass
        os._exit(128 + signum)
    for s in RELAYED:
        _startup[s] = signal.signal(s, interrupted)


def end_startup_guard() -> None:
    for s, previous in _startup.items():
        signal.signal(s, previous)
    _startup.clear()


def exit_quietly(code: int, environ=os.environ, wait_s: float = 10.0) -> None:
    """End this worker with ``code`` after an error it has printed (the same on every rank),
    without a launcher's report of it. torchrun answers any worker's non-zero exit with a
    40-line ChildFailedError traceback, and keeps quiet only if it is gone first: local rank 0
    ends its torchrun agent (SIGKILL; the shell reports the exit as 137), the other local
    ranks wait until it is gone. Under mpirun the other ranks wait a second (mpirun ends them
    when rank 0 exits), so that rank 0's line comes before mpirun's report, which names the
    first rank to exit."""
    if kind(environ) == "mpirun" and not says(environ):
        time.sleep(1.0)
    if kind(environ) == "torchrun":
        agent = os.getppid()
        if environ.get("LOCAL_RANK", "0") == "0" and _is_torchrun(agent):
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.kill(agent, signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        while os.getppid() == agent and _is_torchrun(agent) and time.monotonic() < deadline:
            time.sleep(0.05)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _is_torchrun(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"torchrun" in cmdline or b"torch.distributed.run" in cmdline or b"torch.distributed.launch" in cmdline


# -- the relay: the launcher's signal, passed on to a rank at once ---------------------------------
def start_relay(environ=os.environ) -> subprocess.Popen | None:
    """Under mpirun, when this rank leads a process group of its own in its launcher's session:
    start :func:`relay` (a separate Python, no imports) in the launcher's process group. Else
    (other launchers signal their workers themselves; a rank already in the launcher's group
    hears the signal directly; ``REDSYNC_RELAY=0`` in the environment) None."""
    if kind(environ) != "mpirun" or environ.get("REDSYNC_RELAY", "1") == "0":
        return None
    parent = os.getppid()
    try:
        group, mine = os.getpgid(parent), os.getpgid(0)
        if group == mine or os.getsid(parent) != os.getsid(0):
            return None
    except OSError:
        return None
    # without the launcher's variables it is no rank to anyone who looks (tests find ranks by them)
    env = {k: v for k, v in environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    return subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(group)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def relay(rank_pid: int, group: int) -> None:
    """The relay process: 1. join the launcher's process group (where Ctrl-C and ``kill -<pgid>``
    land); 2. pass SIGINT and SIGTERM on to the rank as they come; 3. end when the rank does."""
    try:
        os.setpgid(0, group)                                                            # 1.
    except OSError:
        return   # the launcher is gone already, or in another session

    def forward(signum, frame):                                                       # 2.
        try:
            os.kill(rank_pid, signum)
        except ProcessLookupError:
            os._exit(0)
    for s in RELAYED:
        signal.signal(s, forward)
    while os.getppid() == rank_pid:                                                     # 3.
        time.sleep(0.5)


if __name__ == "__main__":
    relay(int(sys.argv[1]), int(sys.argv[2]))
