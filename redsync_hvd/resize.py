"""What happens to per-worker compression state when the number of workers changes.

Each worker keeps state that no other worker has: the residual r (error feedback: gradient
computed but not yet sent) and, with DGC momentum correction, the velocity u. Both live in
the memory's ``state_dict()`` as ``{"residual": {layer: tensor}, "velocity": {layer: tensor}}``
(:class:`redsync_hvd.memory.ResidualMemory`, :class:`redsync_hvd.memory.MomentumCorrectionMemory`),
inside the exchange's ``state_dict()["memory"]``.

Two rules, chosen explicitly (``"error"`` is the default everywhere: refuse and explain):

``"sum"``
    Old rank i's state goes to new rank ``i % N``; a new rank holding several adds them up.
    What must survive a resize is the signal still owed to the model: every element of every
    residual is a piece of some worker's gradient that has not reached the weights yet, and
    the exchange delivers it later as ``lr / N * sum_j r_j``. Adding residuals conserves
    ``sum_j r_j`` exactly, so nothing is lost or counted twice; averaging them would lose a
    factor, and any other placement changes only *which* worker sends an element, not
    whether it arrives. Velocities are linear in the same way (their future contribution to
    the residual is ``m / (1 - m) * u``), so they are added too.

    The weight update owed is ``lr / N * sum r``. With ``lr`` scaled by the number of workers
    (``optimizer.scale_lr_by_workers``) ``lr / N`` is constant and the plain sum conserves
    it; otherwise pass ``scale = pending_update_scale(M, N, lr_old, lr_new)`` = ``(N / M) *
    (lr_old / lr_new)``, which conserves ``lr / N * sum r`` instead.
``"reset"``
    The state is dropped; :func:`nonzero` counts what was dropped (elements that were owed
    to the model), for the log and ``summary.json``.

Methods whose state is not a per-worker residual cannot be resized: decentralized methods
keep one model (and neighbour replicas) per worker.
"""
from __future__ import annotations

from typing import Sequence

import torch

RULES = ("error", "sum", "reset")
MEMORY_KEYS = ("residual", "velocity")
# error feedback in update units (memory/adam.py): each worker's Adam moments. They are statistics
# of a worker's gradients, not signal owed to the model: "sum" averages them (and keeps the most
# steps taken, for the bias correction), "reset" drops them with the residuals.
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


class ResizeError(ValueError):
    """A resize that the chosen rule does not allow, or state that cannot be resized."""


def check_rule(rule: str, knob: str = "training.on_resize") -> str:
    if rule not in RULES:
        raise ResizeError(f"{knob}={rule!r} is not one of {RULES}: 'error' refuses a different number of "
                          "workers, 'sum' adds each old worker's residual into new rank i % N, "
                          "'reset' drops residuals and reports how many elements were dropped")
    return rule


def explain(old_size: int, new_size: int, knob: str = "training.on_resize") -> str:
    """The message of a refused resize: what is at stake and the two ways to go on."""
    return (f"the checkpoint was written by {old_size} workers and this run has {new_size}. Each worker's "
            "checkpoint holds its residual (gradient computed but not yet sent), which belongs to that "
            f"worker alone. Choose what to do with it: --set {knob}=sum adds old rank i's residual into new "
            f"rank i % {new_size} (nothing is lost), --set {knob}=reset drops them (the number of dropped "
            f"elements is logged and written to summary.json); or start {old_size} workers")


def pending_update_scale(old_size: int, new_size: int, lr_old: float = 1.0, lr_new: float = 1.0) -> float:
    """Factor on merged residuals that keeps the owed weight update ``lr / N * sum r`` unchanged:
    ``(N / M) * (lr_old / lr_new)``. It is 1 when the learning rate scales with the workers."""
    return (new_size / old_size) * (lr_old / lr_new)


def nonzero(memory_state: dict | None) -> dict:
    """{"residual": n, "velocity": n}: nonzero elements of a memory state (what a reset drops)."""
    out = dict.fromkeys(MEMORY_KEYS, 0)
    for key in MEMORY_KEYS:
        for t in ((memory_state or {}).get(key) or {}).values():
            out[key] += int(torch.count_nonzero(t))
    return out


def merge(states: Sequence[dict | None], rule: str, scale: float = 1.0) -> tuple[dict, dict]:
    """One new worker's memory state from the old workers' states assigned to it.

    1. ``"reset"``: empty residual and velocity, and no Adam moments (each layer starts at zero on
       its first step); the dropped nonzero elements are counted.
    2. ``"sum"``: per layer, the float32 sum of the given states' tensors, times ``scale``;
       a layer some states lack counts as zero there. Nothing is dropped. Adam moments (error
       feedback in update units) are averaged instead, unscaled.
    Returns (memory state, {"residual": dropped, "velocity": dropped}).
    """
    check_rule(rule)
    if rule == "error":
        raise ResizeError("merge() with rule 'error': the caller must refuse the resize first")
    present = [s for s in states if s is not None]
    if rule == "reset":
        dropped = dict.fromkeys(MEMORY_KEYS, 0)
        for s in present:
            for key, n in nonzero(s).items():
                dropped[key] += n
        return {key: {} for key in MEMORY_KEYS}, dropped
    merged: dict = {}
    for key in MEMORY_KEYS:
        if not any(key in s for s in present):
            continue
        acc: dict = {}
        for s in present:
            for name, t in (s.get(key) or {}).items():
                t = t.detach().float()
                acc[name] = t.clone() if name not in acc else acc[name].add_(t.to(acc[name].device))
        merged[key] = {name: t.mul_(scale) if scale != 1.0 else t for name, t in acc.items()}
    merged.update(_averaged_moments(present))
    return merged, dict.fromkeys(MEMORY_KEYS, 0)


def _averaged_moments(states: list) -> dict:
    """Per layer, the mean of the given states' Adam moments over the states that hold the layer,
    and the largest step count among them."""
    out: dict = {}
    for key in MOMENT_KEYS:
        held: dict = {}
        for s in states:
            for name, t in (s.get(key) or {}).items():
                held.setdefault(name, []).append(t.detach().float())
        if held:
            out[key] = {name: torch.stack([t.to(ts[0].device) for t in ts]).mean(0) for name, ts in held.items()}
    steps = [s.get("steps") or {} for s in states]
    if any(steps):
        out["steps"] = {name: max(st.get(name, 0) for st in steps) for name in set().union(*steps)}
    return out


def assignment(old_size: int, new_size: int, new_rank: int) -> list:
    """The old ranks whose state new rank ``new_rank`` takes over: i with i % N == new_rank."""
    return [i for i in range(old_size) if i % new_size == new_rank]


def remap(states: Sequence[dict | None], new_size: int, rule: str, scale: float = 1.0) -> tuple[list, dict]:
    """All new workers' memory states from all old ones (``merge`` per new rank); with the
    total dropped counts. Each rank of a real resume only merges its own share."""
    out, dropped = [], dict.fromkeys(MEMORY_KEYS, 0)
    for j in range(new_size):
        state, d = merge([states[i] for i in assignment(len(states), new_size, j)], rule, scale)
        out.append(state)
        for key in MEMORY_KEYS:
            dropped[key] += d[key]
    return out, dropped
