"""Stop and save on every rank at the same step: on SIGTERM/SIGINT, and every few minutes.

Schedulers preempt with SIGTERM, users press Ctrl-C, and either may reach one rank only.
A rank that stopped alone would leave the others waiting in a collective (or, if each
saved on its own, checkpoints of different steps). So a signal only sets a flag, and at
a step boundary all ranks combine their flags (``[SIGTERM received, SIGINT received,
wall-clock checkpoint due]``) in one collective: they all see the same result and save
(and stop) at the same step.

A loop's part::

    ctl = StopController(horovod_max(), checkpoint_every_s=600, poll_every_s=1.0).install()
    for step ...:
        train_step()
        p = ctl.poll(step)                 # every rank, every step (a collective now and then)
        if p.save:
            checkpoint.save(run_dir, rank, blob); ctl.saved()
        if p.stop:
            ctl.barrier()                  # every rank has saved before any exits
            print(ctl.message(step, run_dir)); return EXIT_STOPPED
    ctl.uninstall()

A poll is a collective of its own: a Horovod cycle or more, often longer than a small
model's step (``scripts/bench_poll.py``). The runner (redsync_hvd/runner.py) therefore
carries ``ctl.flags()`` in the allreduce the gradient exchange makes every step anyway (its
finite check) and calls ``ctl.decide`` on the sums; ``poll`` with ``poll_every_s`` is the
fallback for steps without that allreduce.

A second signal of the same kind while the first is pending ends the process at once (the
default action), so a stuck job can still be interrupted; under a launcher
(``force_on_repeat=False``) it is ignored instead: launchers follow their own signal with
another (mpirun's SIGTERM after the relayed Ctrl-C, redsync_hvd/launchers.py) and end a
stuck job themselves with SIGKILL.

Surviving the launcher while stopping: :meth:`StopController.watch_parent` stops as on SIGTERM
when the launcher (the parent process) is gone; :class:`QuietStream` keeps a closed stdout
or stderr from ending the process with BrokenPipeError before it has saved; :func:`exit_now`
ends a stopped process without the seconds of interpreter and framework shut-down that a
launcher's SIGKILL may cut short.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable, NamedTuple, NoReturn, Sequence

from .launchers import exit_flushed

# EX_TEMPFAIL (sysexits.h): "temporary failure, retry later": the run saved and can be resumed
EXIT_STOPPED = 75


class Poll(NamedTuple):
    save: bool           # every rank saves a checkpoint at this step
    stop: bool           # ... and then stops
    reason: str | None   # "SIGTERM", "SIGINT", "checkpoint_every_s" or None


class StopController:
    """Signal flags + periodic-save clock, agreed across ranks in one collective per poll.

    ``allreduce_max(values: list[float]) -> list[float]``: the element-wise max over ranks
    (:func:`horovod_max`, :func:`torch_distributed_max`, :func:`allgather_max`).
    ``checkpoint_every_s``: wall-clock period of checkpoints (0 or None: none).
    ``poll_every``: steps between polls; every rank must call ``poll`` with the same step
    numbers (it decides from ``step`` alone whether to take part in the collective).
    ``poll_every_s``: instead, poll about that often: each poll also agrees on the slowest
    rank's seconds per step, and the next poll comes that many seconds of steps later (the
    same step on every rank, since all see the same maximum).

    A caller that already makes a collective every step can carry :meth:`flags` in it
    (summed or maxed over ranks) and call :meth:`decide` with the result, instead of ``poll``.
    """

    def __init__(self, allreduce_max: Callable[[list], Sequence[float]], checkpoint_every_s: float | None = 600.0,
                 poll_every: int = 1, clock: Callable[[], float] = time.monotonic, poll_every_s: float | None = None,
                 force_on_repeat: bool = True):
        if poll_every < 1:
            raise ValueError(f"poll_every={poll_every} must be >= 1")
        self.allreduce_max = allreduce_max
        self.every_s = float(checkpoint_every_s or 0.0)
        self.poll_every, self.poll_every_s = int(poll_every), poll_every_s
        self.clock = clock
        self.force_on_repeat = force_on_repeat
        self.signals: tuple = (signal.SIGTERM, signal.SIGINT)
        self.signum = 0              # the signal received on this rank (0: none)
        self.heard_at: float | None = None   # time.time() when it came
        self.reason: str | None = None
        self._watching = threading.Event()
        self._last_save = clock()
        self._previous: dict = {}
        self._last_poll: tuple | None = None   # (step, time) of the last own poll
        self._next_poll = 0

    # -- signals ----------------------------------------------------------------------------
    def install(self, signals=(signal.SIGTERM, signal.SIGINT)) -> "StopController":
        """Route ``signals`` to the flag (main thread only, as Python requires)."""
        self.signals = tuple(signals)
        for s in signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()
        self._watching.clear()

    def watch_parent(self, interval: float = 1.0) -> "StopController":
        """Stop as on SIGTERM once this process's parent (its launcher) is gone: its output pipes
        are then closed and nothing will signal it any more. A thread looks every ``interval`` s."""
        parent = os.getppid()
        self._watching.set()

        def watch():
            while self._watching.is_set():
                if os.getppid() != parent:
                    self.request_stop(signal.SIGTERM)
                    return
                time.sleep(interval)
        threading.Thread(target=watch, name="rsync-parent-watch", daemon=True).start()
        return self

    def __enter__(self) -> "StopController":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_signal(self, signum, frame) -> None:
        if self.signum == signum and self.force_on_repeat:   # the second one: what it would do without us
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.request_stop(signum)

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop as a signal would (e.g. from a watchdog thread); the first request counts."""
        if not self.signum:
            self.signum, self.heard_at = int(signum), time.time()

    # -- per step ---------------------------------------------------------------------------
    def flags(self) -> list:
        """This rank's [one 0/1 per installed signal received, wall-clock checkpoint due]: the
        same length on every rank, to be combined by max or sum."""
        due = bool(self.every_s) and self.clock() - self._last_save >= self.every_s
        return [float(self.signum == s) for s in self.signals] + [float(due)]

    def decide(self, combined: Sequence[float]) -> Poll:
        """What every rank does, from every rank's :meth:`flags` combined (any nonzero counts).

        1. A signal anywhere: save and stop.
        2. A checkpoint due anywhere: save, and restart the clock on every rank."""
        for s, value in zip(self.signals, combined):
            if value > 0:
                self.reason = signal.Signals(s).name
                return Poll(True, True, self.reason)
        if combined[len(self.signals)] > 0:
            self._last_save = self.clock()
            return Poll(True, False, "checkpoint_every_s")
        return Poll(False, False, None)

    def poll(self, step: int, force: bool = False) -> Poll:
        """:meth:`decide` on this step's flags of all ranks, by one collective of its own.

        1. Not a polling step (``step % poll_every``, or before the step ``poll_every_s``
           planned) and not ``force``d: nothing to do, no collective. ``force`` must be the same
           on every rank at a step (the runner forces it at its step-based saves: ranks that
           meet only every few steps, as under local steps, then save each step together).
        2. Allreduce (max) of this rank's flags and its seconds per step since the last poll.
        3. Plan the next poll from the slowest rank's step time (``poll_every_s``); decide."""
        if not force and ((step < self._next_poll) if self.poll_every_s else (step % self.poll_every)):
            return Poll(False, False, None)
        now = self.clock()
        per_step = (now - self._last_poll[1]) / max(1, step - self._last_poll[0]) if self._last_poll else 0.0
        combined = list(self.allreduce_max(self.flags() + [per_step]))
        self._last_poll = (step, now)
        if self.poll_every_s:
            slowest = combined[-1]
            self._next_poll = step + (1 if slowest <= 0 else max(1, min(1000, int(self.poll_every_s / slowest))))
        return self.decide(combined)

    def saved(self) -> None:
        """A checkpoint was written (step-based too): the wall-clock period starts again."""
        self._last_save = self.clock()

    def barrier(self) -> None:
        """Every rank reaches this point before any goes on: after the final save, before exit."""
        self.allreduce_max([0.0, 0.0])

    def message(self, step: int, run_dir) -> str:
        return (f"stopped at step {step} on {self.reason or 'request'}: every rank saved its checkpoint in "
                f"{run_dir}; continue with --set training.resume={run_dir}")


def allgather_max(allgather_object: Callable, name: str = "rsync.poll") -> Callable[[list], list]:
    """``allreduce_max`` from any framework's ``allgather_object(obj, name=)`` (what the runner's
    adapters provide): every rank gathers every rank's list and takes the maxima."""
    def allreduce_max(values: list) -> list:
        return [max(column) for column in zip(*allgather_object(list(values), name=name))]
    return allreduce_max


def horovod_max(hvd=None, name: str = "rsync.poll") -> Callable[[list], list]:
    """``allreduce_max`` over Horovod (``horovod.torch`` unless another module is given)."""
    if hvd is None:
        import horovod.torch as hvd
    import torch

    def allreduce_max(values: list) -> list:
        return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Max, name=name).tolist()
    return allreduce_max


def torch_distributed_max(group=None, device="cpu") -> Callable[[list], list]:
    """``allreduce_max`` over ``torch.distributed`` (an initialised default or given group;
    ``device="cuda"`` for NCCL)."""
    import torch
    import torch.distributed as dist

    def allreduce_max(values: list) -> list:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()
    return allreduce_max


class QuietStream:
    """A text stream that stops writing, silently, once its reader is gone (BrokenPipeError or
    another OSError): a launcher that closes a rank's stdout while it stops must not end it
    before it has saved. Wrap ``sys.stderr`` for a progress bar, or use :func:`say`."""

    def __init__(self, stream):
        self.stream, self.broken = stream, False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self.stream.write(text)
            except (OSError, ValueError):
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.broken = True

    def isatty(self) -> bool:
        return not self.broken and bool(getattr(self.stream, "isatty", lambda: False)())


def say(text: str, stream=None) -> None:
    """``text`` on stderr (flushed), or nowhere if stderr is closed."""
    out = QuietStream(stream or sys.stderr)
    out.write(text + "\n")
    out.flush()


def exit_now(code: int) -> NoReturn:
    """Flush Python's output and end the process at once with ``code``. A stopped run has saved
    on every rank and passed its last collective; the interpreter's and the frameworks' shut-down
    (Horovod's, a Gloo process group's) can take seconds on a loaded machine, longer than the
    1 s mpirun leaves between its SIGTERM and its SIGKILL."""
    exit_flushed(code)
