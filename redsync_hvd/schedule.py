"""How long a run is and how its learning rate moves: step counts, the schedule, evaluation steps.

The framework adapters build their schedulers from :func:`lr_factor`; the runner's loop
(redsync_hvd/runner.py) counts steps with :func:`total_steps` and evaluates on :func:`eval_due`.
"""
from __future__ import annotations

import math

from .config import RunConfig


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    if cfg.training.steps:
        return cfg.training.steps
    return max(1, int(round(cfg.training.epochs * steps_per_epoch)))


def lr_factor(cfg: RunConfig, steps_per_epoch: int):
    """step -> factor of the base learning rate: linear warm-up, then step or cosine decay (cosine:
    from 1 at step 0 down to ``min_lr_factor`` at the last step)."""
    sched = cfg.optimizer.schedule
    total = total_steps(cfg, steps_per_epoch)

    warm = warmup_steps(cfg, steps_per_epoch)

    def factor(step: int) -> float:
        epoch = step / max(1, steps_per_epoch)
        f = 1.0
        if sched.warmup_epochs and epoch < sched.warmup_epochs:
            f *= (step + 1) / (sched.warmup_epochs * steps_per_epoch)
        elif warm and not sched.warmup_epochs and step < warm:
            f *= (step + 1) / warm
        if sched.type == "step":
            f *= sched.gamma ** sum(epoch >= m for m in sched.milestones)
        elif sched.type == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total))))
            f *= sched.min_lr_factor + (1 - sched.min_lr_factor) * decay if sched.min_lr_factor else decay
        return f
    return factor


def warmup_steps(cfg: RunConfig, steps_per_epoch: int) -> float:
    """The warm-up's length in steps (0: none): ``warmup_steps``, ``warmup_fraction`` of the run,
    or ``warmup_epochs`` (the config holds at most one). The ramp is (step + 1) / length, and it
    multiplies the schedule's factor (a cosine decay runs from step 0 over the whole run)."""
    sched = cfg.optimizer.schedule
    if sched.warmup_steps:
        return float(sched.warmup_steps)
    if sched.warmup_fraction:
        return sched.warmup_fraction * total_steps(cfg, steps_per_epoch)
    return sched.warmup_epochs * steps_per_epoch


def eval_due(cfg: RunConfig, step: int, steps_per_epoch: int, total: int) -> bool:
    """Every ``training.eval_every`` steps, else at each epoch's end; always at the last step."""
    every = cfg.training.eval_every
    return bool((every and step % every == 0) or (not every and step % steps_per_epoch == 0) or step == total)
