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

It also holds what a rank and its launcher do around that: the start-up guard (one line for a
Ctrl-C before the first step), a refusal's quiet exit under torchrun, and horovodrun's own
process (:func:`hook_horovodrun`, :func:`supervise`: it waits for its job's ranks).

This module imports nothing outside the standard library: ``python -I -S launchers.py`` is
the relay process (``relay``), started before anything heavy is imported, and
``python -I -S launchers.py supervise ...`` is horovodrun's process: one file, so that both run
from its path alone.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import NoReturn

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
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMIX_RANK", "PMI_RANK")
_startup: dict = {}
_relays: list = []   # this rank's relay (start_relay), told when training starts


def rank(environ=os.environ) -> int | None:
    """This worker's global rank from its launcher's variables (torchrun: RANK), or None (a plain
    process): what decides, before any framework starts, which rank prints a shared error."""
    names = ("RANK",) if "TORCHELASTIC_RUN_ID" in environ else RANK_VARS
    for name in names:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return None


def says(environ=os.environ) -> bool:
    """Whether this process prints what every rank would print alike: rank 0, or a plain process."""
    return rank(environ) in (None, 0)


def note(line: str, environ=os.environ) -> bool:
    """Tell horovodrun's process (:func:`supervise`, through the file it names in
    ``REDSYNC_JOB_NOTES``) how far rank 0 got: "training", "said" once it printed the line that
    ends an interrupted launch, or "say <line>" for that process to print (:func:`tell`).
    Returns whether the note was written."""
    path = environ.get("REDSYNC_JOB_NOTES")
    if path and says(environ):
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
            return True
        except OSError:
            pass
    return False


def startup_line(signum: int) -> str:
    return (f"interrupted ({signal.Signals(signum).name}) while starting, before the first step: nothing was trained "
            "or saved\n")


def guard_startup(environ=os.environ) -> None:
    """Until :func:`end_startup_guard` (the training loop's own handlers take over): Ctrl-C or
    SIGTERM ends this process at once with one line from rank 0 and exit code 128 + signal,
    instead of a KeyboardInterrupt traceback from whatever import or collective it was in.
    Nothing is lost: no step has been trained yet. A rank with a relay leaves the line to the
    relay, which says it at once: this handler waits for the C call in progress (loading
    torch's libraries takes seconds on a loaded machine), and mpirun's SIGKILL may come first."""
    def interrupted(signum, frame):
        if says(environ) and not any(r.says_startup for r in _relays):
            try:
                os.write(2, startup_line(signum).encode())
                note("said", environ)
            except OSError:
                pass
        os._exit(128 + signum)
    for s in RELAYED:
        _startup[s] = signal.signal(s, interrupted)


def end_startup_guard() -> None:
    """Training starts: the loop's handlers from now on, and the relay says nothing of its own."""
    for s, previous in _startup.items():
        signal.signal(s, previous)
    _startup.clear()
    note("training")
    for relay_process in _relays:
        try:
            relay_process.stdin.write(b"started\n")
            relay_process.stdin.flush()
        except (OSError, ValueError):
            pass


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
    exit_flushed(code)


def exit_flushed(code: int) -> NoReturn:
    """Flush Python's output and end the process at once with ``code``, skipping the
    interpreter's and the frameworks' shut-down (Horovod's, a Gloo process group's)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def close_process_group(code: int = 0) -> NoReturn:
    """End a torch.distributed job on every rank and exit with ``code``: a barrier, so every
    rank is done, then the process ends at once (:func:`exit_flushed`). torch 2.13's Gloo
    teardown (``destroy_process_group`` and the interpreter's shut-down) ended such jobs on a
    loaded machine with "terminate called without an active exception" (SIGABRT) after their
    last collective; with nothing left to send, skipping it loses nothing. Every rank must call it."""
    import torch.distributed as dist  # here: this module loads at every Python start-up
    dist.barrier()
    exit_flushed(code)


def _is_torchrun(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"torchrun" in cmdline or b"torch.distributed.run" in cmdline or b"torch.distributed.launch" in cmdline


# -- the relay: the launcher's signal, passed on to a rank at once ---------------------------------
def start_relay(environ=os.environ, says_startup: bool = False) -> subprocess.Popen | None:
    """Under mpirun, when this rank leads a process group of its own in its launcher's session:
    start :func:`relay` (a separate Python, no imports) in the launcher's process group. Else
    (other launchers signal their workers themselves; a rank already in the launcher's group
    hears the signal directly; ``REDSYNC_RELAY=0`` in the environment) None. ``says_startup``:
    rank 0's relay says :func:`guard_startup`'s line on a signal until :func:`end_startup_guard`
    (the runner's; a loop of your own that does not call it leaves this off)."""
    if kind(environ) != "mpirun" or environ.get("REDSYNC_RELAY", "1") == "0":
        return None
    parent = os.getppid()
    try:
        group, mine = os.getpgid(parent), os.getpgid(0)
        if group == mine or os.getsid(parent) != os.getsid(0):
            return None
    except OSError:
        return None
    if _relays:
        return _relays[0]
    hold_launcher_stderr()
    # without the launcher's variables it is no rank to anyone who looks (tests find ranks by them)
    env = {k: v for k, v in environ.items() if not k.startswith(("OMPI_", "PMIX_", "HOROVOD_"))}
    speaks = says_startup and says(environ)
    process = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), str(group),
                                "1" if speaks else "0"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    process.says_startup = speaks
    _relays.append(process)
    return process


def relay(rank_pid: int, group: int, speaks: bool = False) -> None:
    """The relay process (its stderr is its rank's): 1. join the launcher's process group (where
    Ctrl-C and ``kill -<pgid>`` land); 2. pass SIGINT and SIGTERM on to the rank as they come and,
    for rank 0 (``speaks``) while it is still starting (no "started" from it on stdin), say the
    start-up line of :func:`guard_startup` for it; 3. end when the rank does."""
    try:
        os.setpgid(0, group)                                                            # 1.
    except OSError:
        return   # the launcher is gone already, or in another session
    os.set_blocking(0, False)
    state = {"started": False, "said": False}

    def forward(signum, frame):                                                       # 2.
        try:
            state["started"] = state["started"] or bool(os.read(0, 64))
        except (BlockingIOError, OSError):
            pass
        if speaks and not state["started"] and not state["said"]:
            state["said"] = True
            try:
                os.write(2, startup_line(signum).encode())
                note("said", {"REDSYNC_JOB_NOTES": os.environ.get("REDSYNC_JOB_NOTES", "")})
            except OSError:
                pass
        try:
            os.kill(rank_pid, signum)
        except ProcessLookupError:
            os._exit(0)
    for s in RELAYED:
        signal.signal(s, forward)
    while os.getppid() == rank_pid:                                                     # 3.
        time.sleep(0.5)


# -- what a rank says when its launcher may be gone -----------------------------------------------
_launcher_stderr: list = []   # [(the launcher's pid, a file of its stderr)], opened while it runs


def hold_launcher_stderr() -> None:
    """Under mpirun, while it runs: open its stderr (the job's log or terminal) for :func:`tell`.
    Appending: the file is the launcher's, and it writes there no more once it is gone."""
    if _launcher_stderr:
        return
    parent = os.getppid()
    try:
        _launcher_stderr.append((parent, open(f"/proc/{parent}/fd/2", "a", buffering=1)))
    except OSError:
        pass   # a socket, or no /proc: the rank's own stderr it is


def tell(text: str) -> None:
    """``text``, the line that ends a stopped run, from rank 0. Under horovodrun's process
    (:func:`supervise`) it goes into that process's notes, and that process prints it once the job
    has ended: a second signal (a wrapper such as ``timeout`` sends one) ends mpirun at once, and a
    line handed to mpirun while it was ending was lost. Else on stderr, or where mpirun is gone,
    straight into the launcher's stderr, which nobody reads for us now."""
    if note(f"say {text}"):
        return
    if _launcher_stderr and os.getppid() != _launcher_stderr[0][0]:
        stream = _launcher_stderr[0][1]
    else:
        stream = sys.stderr
    try:
        stream.write(text + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass
    note("said")


# -- horovodrun's own process: it waits for its job ----------------------------------------------
def hook_horovodrun() -> None:
    """Run in horovodrun's Python as it starts (the venv's ``redsync_hvd.pth``, which
    scripts/install.sh writes): 1. Ctrl-C before the job starts ends in one line, not a
    traceback; 2. where horovodrun would replace itself by ``/bin/sh -c "mpirun ..."``, it runs
    that shell under :func:`supervise` instead (the same process, so whoever waits for horovodrun
    waits for the job)."""
    previous = sys.excepthook

    def interrupted(kind_, value, tb):
        if not issubclass(kind_, KeyboardInterrupt):
            return previous(kind_, value, tb)
        sys.stderr.write("horovodrun: interrupted before the job started: nothing ran\n")
    sys.excepthook = interrupted
    execve = os.execve

    def launch(path, args, env):
        if path == "/bin/sh" and len(args) == 3 and args[1] == "-c" and args[2].lstrip().startswith("mpirun "):
            execve(sys.executable, [sys.executable, "-I", "-S", os.path.abspath(__file__), "supervise", *args], env)
        execve(path, args, env)
    os.execve = launch


def supervise(command: list) -> None:
    """horovodrun's process for the life of its job, around the shell that runs mpirun.

    mpirun ends at once, leaving its ranks behind, on a second SIGINT or SIGTERM within 5 s, and
    a wrapper that passes a signal on to its process group (``timeout``, some shells) delivers a
    second one with the first. horovodrun then returned while the ranks were still saving, and
    their resume hint went to a pipe nobody read. Here:

    1. this process adopts the job's orphans (PR_SET_CHILD_SUBREAPER);
    2. SIGINT and SIGTERM are noted, not fatal (mpirun and the ranks' relays hear a signal to the
       process group themselves); one that mpirun did not hear (sent to this pid alone: mpirun
       still runs when its stop would have ended) reaches it then; one a second or more after the
       first, once the shell has ended, ends the orphans at once;
    3. once the shell has ended, ranks it left behind have until the end of their stop window
       (:func:`stop_window`, counted from the signal), then get the SIGKILL mpirun would have sent;
    4. exit as the shell did, when no process of the job is left: first with the line rank 0 left
       it to say (:func:`tell`: a stopped run's resume hint, printed after the job's last line);
       after a signal, with one line of its own if rank 0 said none (it was killed before it
       could: a Ctrl-C in the first second of a rank's start, a stop that outlasted its window),
       from what rank 0 noted (:func:`note`)."""
    import ctypes
    import tempfile
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        os.execv(command[0], command)   # no way to adopt the orphans: horovodrun's own behaviour
    heard: list = []
    fd, notes = tempfile.mkstemp(prefix="redsync-job-", suffix=".notes")
    os.close(fd)
    os.environ["REDSYNC_JOB_NOTES"] = notes
    signal.signal(signal.SIGINT, lambda s, f: heard.append((s, time.monotonic())))
    signal.signal(signal.SIGTERM, lambda s, f: heard.append((s, time.monotonic())))
    shell = os.fork()
    if shell == 0:
        for s in RELAYED:
            signal.signal(s, signal.SIG_DFL)
        os.execv(command[0], command)
    window = 2 * _sigkill_timeout(command[-1]) + 1.0
    status, ended = _wait_for_job(shell, heard, window)
    _say_what_ranks_did_not(heard, notes)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def _wait_for_job(shell: int, heard: list, window: float) -> tuple:
    """Reap the shell and every orphan of the job (steps 2 and 3 of :func:`supervise`):
    (the shell's wait status, when it ended)."""
    status, ended, forwarded = None, None, False
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status, ended
        if pid == shell:
            status, ended = code, time.monotonic()
        if pid:
            continue
        now = time.monotonic()
        if status is None and heard and not forwarded and now - heard[0][1] >= window:
            forwarded = True   # mpirun would have ended its job by now had it heard the signal
            for child in _children(shell):   # mpirun, if this signal was not its own
                _kill(child, heard[0][0])
        if status is not None:
            start = heard[0][1] if heard else ended
            insisted = any(t > ended and t - heard[0][1] >= 1.0 for _, t in heard)   # not the first burst
            if now >= start + window or insisted:
                for child in _children(os.getpid()):
                    _kill(child, signal.SIGKILL)
        time.sleep(0.05)


def _say_what_ranks_did_not(heard: list, notes: str) -> None:
    """Step 4 of :func:`supervise`: the lines rank 0 left to say (:func:`tell`), else one for a
    signal that left none."""
    try:
        with open(notes) as f:
            said = f.read().splitlines()
        os.unlink(notes)
    except OSError:
        said = []
    told = "".join(f"{n[4:]}\n" for n in said if n.startswith("say "))
    if not told and (not heard or "said" in said):
        return
    name = signal.Signals(heard[0][0]).name if heard else ""
    if told:
        line = told
    elif "training" in said:
        line = (f"interrupted ({name}): the ranks ended before they saved (a stop that outlasted the launcher's "
                "window; docs/reliability.md); the run folder keeps its last checkpoints\n")
    else:
        line = startup_line(heard[0][0])
    try:
        os.write(2, line.encode())
    except OSError:
        pass


def _children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _sigkill_timeout(mpirun_command: str) -> float:
    """mpirun's odls_base_sigkill_timeout: from ``--mca`` in its command, else as :func:`sigkill_timeout`."""
    words = mpirun_command.split()
    for i, word in enumerate(words[:-2]):
        if word in ("--mca", "-mca") and words[i + 1] == "odls_base_sigkill_timeout":
            try:
                return float(words[i + 2].strip("'\""))
            except ValueError:
                break
    return sigkill_timeout()


if __name__ == "__main__":
    if sys.argv[1] == "supervise":
        supervise(sys.argv[2:])
    else:
        relay(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] == ["1"])
