"""Stop and save on every rank at the same step: on SIGTERM/SIGINT, and every few minutes.

Schedulers preempt with SIGTERM, users press Ctrl-C, and either may reach one rank only.
A rank that stopped alone would leave the others waiting in a collective (or, if each
saved on its own, checkpoints of different steps). So a signal only sets a flag, and at
a step boundary all ranks combine their flags with one tiny allreduce (max) of
``[signal received, wall-clock checkpoint due]``: they all see the same result and save
(and stop) at the same step.

The runner's part::

    ctl = StopController(horovod_max(), checkpoint_every_s=cfg.training.checkpoint_every_s).install()
    for step ...:
        train_step()
        p = ctl.poll(step)                 # every rank, every step (one collective every poll_every)
        if p.save:
            checkpoint.save(run_dir, rank, blob); ctl.saved()
        if p.stop:
            ctl.barrier()                  # every rank has saved before any exits
            print(ctl.message(step, run_dir)); return EXIT_STOPPED
    ctl.uninstall()

A second signal of the same kind while the first is pending ends the process at once (the
default action), so a stuck job can still be interrupted.
"""
from __future__ import annotations

import signal
import time
from typing import Callable, NamedTuple, Sequence

# EX_TEMPFAIL (sysexits.h): "temporary failure, retry later": the run saved and can be resumed
EXIT_STOPPED = 75


class Poll(NamedTuple):
    save: bool           # every rank saves a checkpoint at this step
    stop: bool           # ... and then stops
    reason: str | None   # "SIGTERM", "SIGINT", "checkpoint_every_s" or None


class StopController:
    """Signal flag + periodic-save clock, agreed across ranks in one allreduce per poll.

    ``allreduce_max(values: list[float]) -> list[float]``: the element-wise max over ranks
    (:func:`horovod_max`, :func:`torch_distributed_max`). ``checkpoint_every_s``: wall-clock
    period of checkpoints (0 or None: none). ``poll_every``: steps between polls; every rank
    must call ``poll`` with the same step numbers (it decides from ``step`` alone whether to
    take part in the collective).
    """

    def __init__(self, allreduce_max: Callable[[list], Sequence[float]], checkpoint_every_s: float | None = 600.0,
                 poll_every: int = 1, clock: Callable[[], float] = time.monotonic):
        if poll_every < 1:
            raise ValueError(f"poll_every={poll_every} must be >= 1")
        self.allreduce_max = allreduce_max
        self.every_s = float(checkpoint_every_s or 0.0)
        self.poll_every = int(poll_every)
        self.clock = clock
        self.signum = 0              # the signal received on this rank (0: none)
        self.reason: str | None = None
        self._last_save = clock()
        self._previous: dict = {}

    # -- signals ----------------------------------------------------------------------------
    def install(self, signals=(signal.SIGTERM, signal.SIGINT)) -> "StopController":
        """Route ``signals`` to the flag (main thread only, as Python requires)."""
        for s in signals:
            self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def uninstall(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()

    def __enter__(self) -> "StopController":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _on_signal(self, signum, frame) -> None:
        if self.signum == signum:   # the second one: do what it would have done without us
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        self.signum = signum

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop as a signal would (e.g. from a watchdog thread)."""
        self.signum = int(signum)

    # -- per step ---------------------------------------------------------------------------
    def poll(self, step: int) -> Poll:
        """What every rank does at this step (the same on all ranks).

        1. Off-poll steps (``step % poll_every``): nothing to do, no collective.
        2. Allreduce (max) of [signal number received here, wall-clock checkpoint due here].
        3. A signal anywhere: save and stop. A checkpoint due anywhere: save, and restart
           the clock on every rank (they all see the same result).
        """
        if step % self.poll_every:
            return Poll(False, False, None)
        due = bool(self.every_s) and self.clock() - self._last_save >= self.every_s
        signum, any_due = (int(v) for v in self.allreduce_max([float(self.signum), float(due)]))
        if signum:
            self.reason = signal.Signals(signum).name
            return Poll(True, True, self.reason)
        if any_due:
            self._last_save = self.clock()
            return Poll(True, False, "checkpoint_every_s")
        return Poll(False, False, None)

    def saved(self) -> None:
        """A checkpoint was written (step-based too): the wall-clock period starts again."""
        self._last_save = self.clock()

    def barrier(self) -> None:
        """Every rank reaches this point before any goes on: after the final save, before exit."""
        self.allreduce_max([0.0, 0.0])

    def message(self, step: int, run_dir) -> str:
        return (f"stopped at step {step} on {self.reason or 'request'}: every rank saved its checkpoint in "
                f"{run_dir}; continue with --set training.resume={run_dir}")


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
