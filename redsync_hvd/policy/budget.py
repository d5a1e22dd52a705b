"""The per-layer density budget of one exchange (``compression.policy.mode: budget``).

:class:`Budget` holds which layers share the budget, each one's k now, and every choice made
so far; the layer policy (layers.py) asks it at start, hands it each unit's compensated x on
a choosing step (``observe``) and lets it choose once that step is committed (``after_step``).
The arithmetic (curves, dynamic program, threshold, filling the budget) is in allocate.py.

    1. start: the budget in bytes per step (``budget.bytes_per_step``, or what uniform
       ``budget.density`` sends), less what the dense layers, the step's finite flag, layers
       with a density of their own and the statistics (amortised) take, is the capacity of the
       shared layers; they start at the uniform density that fills it (or a pinned choice);
    2. every ``budget.every`` steps from the end of the warm-up, ``observe`` measures each shared
       layer's curve (allocate.layer_curve; ``objective: descent``: allocate.descent_curve, from x
       and the step's gradient) on the device, nothing read back;
    3. ``after_step``: one allreduce averages the curves over ranks, every rank chooses, and
       rank 0's k are broadcast, so every rank sends the same k from the next step on.

The k and the choices are state: ``state_dict`` goes into checkpoints through the exchange,
and ``record`` into decisions.json (a run that pins it starts from its last choice).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from ..core.layout import k_of
from .allocate import (
    allocate_dp,
    allocate_threshold,
    candidates,
    carried_curve,
    density_of,
    descent_bought,
    descent_curve,
    fill,
    grid_size,
    layer_curve,
    magnitude_curve,
)


class Budget:
    def __init__(self, config, layers: list, own_density: dict, warmup_steps: Callable[[], int],
                 pinned: dict | None = None, messages: dict | None = None, control_bytes: int = 4):
        """``messages``: {layer name: (its message's Cost, whether it is one sign and one mean)}, from
        the compressor (``LayerPolicy.start_budget``)."""
        b = config.policy.budget
        self.method, self.every, self.spread, self.response = b.method, b.every, b.spread, b.response
        self.objective = b.objective
        self.shared = [l for l in layers if l.compressed and l.name not in own_density]
        if not self.shared:
            raise ValueError("policy.mode=budget has no layer to share the budget between: no layer is compressed "
                             "or every compressed one has a density of its own (policy.layers[].density); "
                             "use policy.mode: static")
        cost_of = {name: cost for name, (cost, _) in messages.items()}
        self.costs = [cost_of[l.name] for l in self.shared]
        self.sign_means = [messages[l.name][1] for l in self.shared]
        self.width = grid_size(self.spread)
        self.stats_bytes = len(self.shared) * (4 * self._row_len() + 8) if self.every else 0
        dense_each = 2 if config.policy.dense_values == "fp16" else 4
        fixed = control_bytes + sum(dense_each * l.numel for l in layers if not l.compressed) + sum(
            cost_of[l.name](k_of(l.numel, own_density[l.name])) for l in layers if l.name in own_density)
        self.reserve = reserve = self.stats_bytes / self.every if self.every else 0.0
        if b.bytes_per_step is None:
            density = b.density if b.density is not None else config.layer_density()
            self.total = fixed + sum(c(k_of(l.numel, density)) for c, l in zip(self.costs, self.shared))
        else:
            self.total = int(b.bytes_per_step)
        self.capacity = math.floor(self.total - fixed - reserve)                                    # 1.
        self._check(fixed, reserve, b.bytes_per_step is not None)
        spend = sum(c.per_element * l.numel for c, l in zip(self.costs, self.shared))
        self.mean = (self.capacity - sum(c.fixed for c in self.costs)) / spend
        self.grids = [candidates(l.numel, self.mean, self.spread) for l in self.shared]
        self.bounds = [(g[0], g[-1]) for g in self.grids]
        self.warmup_steps, self._warmup = warmup_steps, None
        self.pending: dict = {}
        self.history: list = []
        self.revision = 0
        self.uniform = fill([k_of(l.numel, self.mean) for l in self.shared], self.bounds, self.costs, self.capacity)
        pinned_k = self._pinned_k(pinned)
        start = fill(pinned_k, self.bounds, self.costs, self.capacity) if pinned_k else self.uniform
        self._set(start, 0, "pinned start" if pinned_k else "uniform start")

    def _row_len(self) -> int:
        return 1 + (2 if any(self.sign_means) else 1) * self.width

    def _check(self, fixed: int, reserve: float, given_bytes: bool) -> None:
        least = sum(c(1) for c in self.costs)
        most = sum(c(l.numel) for c, l in zip(self.costs, self.shared))
        what = (f"policy.budget.bytes_per_step={self.total}" if given_bytes else
                f"the budget of policy.budget.density ({self.total} bytes a step)")
        stats = f", the budget's statistics {reserve:.1f}" if reserve else ""
        if self.capacity < least:
            raise ValueError(f"{what} leaves {self.capacity} bytes a step for the {len(self.shared)} shared "
                             f"compressed layers after the dense layers and the buckets' counts ({fixed}{stats}); they "
                             f"need at least {least} (one element each). Raise the budget to at least "
                             f"{math.ceil(fixed + reserve + least)} bytes" + (", or raise policy.budget.every"
                                                                              if reserve else ""))
        if self.capacity > most:
            raise ValueError(f"{what} is more than the compressed layers send at density 1 ({fixed + most} bytes a "
                             "step with the rest): lower it, or send them dense (policy.mode: static, density: 1)")

    def _pinned_k(self, pinned: dict | None) -> list | None:
        shared = (pinned or {}).get("budget", {}).get("layers", {})
        if not shared or sorted(shared) != sorted(l.name for l in self.shared):
            return None
        return [int(shared[l.name]["k"]) for l in self.shared]

    # -- 2. observe, 3. choose ----------------------------------------------------------------------
    def due(self, step: int) -> bool:
        if not self.every or step % self.every or step == 0:
            return False
        if self._warmup is None:
            self._warmup = self.warmup_steps()
        return step >= self._warmup

    def observe(self, layers, xs: list, step: int, grads: list) -> None:
        """Each shared layer's curve from its compensated x (and, for ``objective: descent``, the
        step's gradient g)."""
        if not self.due(step):
            return
        where = {l.name: i for i, l in enumerate(self.shared)}
        for layer, x, g in zip(layers, xs, grads):
            if layer.name in where:
                i = where[layer.name]
                args = (self.grids[i], self.width, self.sign_means[i], self._row_len())
                self.pending[layer.name] = (descent_curve(x, g, *args) if self.objective == "descent"
                                            else layer_curve(x, *args))

    def after_step(self, step: int, comm) -> dict:
        """Choose at a step whose curves were observed; the bytes of the two collectives."""
        if not self.pending:
            return {}
        missing = [l.name for l in self.shared if l.name not in self.pending]
        if missing:
            raise RuntimeError(f"policy.mode=budget: no statistics of {missing[:5]} at step {step}: every shared "
                               "layer goes through the exchange every step")
        rows = torch.stack([self.pending.pop(l.name) for l in self.shared])
        mean = comm.wait(comm.allreduce_async(rows, name="rsync.budget.curves", average=True))
        ks, report = self.choose(mean.double().cpu().numpy())
        agreed = comm.wait(comm.broadcast_async(torch.tensor(ks, dtype=torch.int64, device=rows.device), root=0,
                                                name="rsync.budget.k")).cpu().tolist()
        self._set([int(k) for k in agreed], step, self.method, report)
        return {"budget": rows.numel() * 4 + len(ks) * 8}

    def choose(self, rows: np.ndarray) -> tuple:
        """(k per shared layer, what the choice predicts) from the ranks' mean curves."""
        p, formats = self.response, list(zip(rows, self.grids, self.sign_means, self.k))
        if self.objective == "descent":   # most bought; else least carried
            gains = [descent_bought(row, g, sm) for row, g, sm, _ in formats]
        else:
            gains = [-carried_curve(row, g, sm, k, p) for row, g, sm, k in formats]
        if self.method == "dp":
            costs = [[c(k) for k in g] for c, g in zip(self.costs, self.grids)]
            ks = [g[c] for g, c in zip(self.grids, allocate_dp(gains, costs, self.capacity))]
        else:
            curves = [magnitude_curve(row, g, sm, k, p) for row, g, sm, k in formats]
            ks = allocate_threshold(curves, self.bounds, self.costs, self.capacity)
        ks = fill(ks, self.bounds, self.costs, self.capacity)
        total = lambda chosen: sum(float(np.interp(k, g, e))  # noqa: E731
                                   for k, g, e in zip(chosen, self.grids, gains))
        what = "bought" if self.objective == "descent" else "carried"
        sign = 1.0 if self.objective == "descent" else -1.0
        return ks, {"energy": float(rows[:, 0].sum()), what: sign * total(ks),
                    f"{what}_uniform": sign * total(self.uniform), "layer_energy": [float(e) for e in rows[:, 0]]}

    # -- state ---------------------------------------------------------------------------------------
    def _set(self, ks: list, step: int, why: str | None, report: dict | None = None) -> None:
        """Use these k from the next step on; ``why``: noted in the history (None: a restore)."""
        self.k = list(ks)
        for layer, k in zip(self.shared, self.k):
            layer.base_density = density_of(layer.numel, k)
        if why is not None:
            self.history.append({"step": step, "why": why, "k": dict(zip((l.name for l in self.shared), self.k)),
                                 **(report or {})})
            self.revision += 1

    def record(self) -> dict:
        return {"method": self.method, "objective": self.objective, "bytes_per_step": self.total,
                "shared_bytes": self.capacity, "mean_density": self.mean, "every": self.every, "spread": self.spread,
                "stats_bytes": self.stats_bytes,
                "layers": {l.name: {"k": k, "density": l.base_density} for l, k in zip(self.shared, self.k)},
                "history": [dict(h) for h in self.history]}

    def state_dict(self) -> dict:
        return {"k": dict(zip((l.name for l in self.shared), self.k)), "history": [dict(h) for h in self.history],
                "revision": self.revision}

    def load_state_dict(self, state: dict) -> None:
        names = [l.name for l in self.shared]
        if sorted(state.get("k", {})) != sorted(names):
            raise ValueError(f"the checkpoint's budget shares bytes between {sorted(state.get('k', {}))[:5]}, this "
                             f"run between {sorted(names)[:5]}: resume with the config it was saved with")
        self.history = [dict(h) for h in state.get("history", [])]
        self.revision = int(state.get("revision", 0))
        self._set([int(state["k"][n]) for n in names], 0, None)


def log_lines(record: dict, since: int = 0) -> list:
    """layers.log lines of the budget's choices from the ``since``-th on."""
    out = []
    for entry in record.get("history", [])[since:]:
        head = f"[budget] step {entry['step']} ({entry['why']}): {record['bytes_per_step']} bytes a step"
        if "bought" in entry:
            head += f"; first-order descent bought {entry['bought']:.4g} (uniform {entry['bought_uniform']:.4g})"
        elif entry.get("energy"):
            e = entry["energy"]
            head += (f"; error carried {entry['carried'] / e:.4f} of x's energy (uniform "
                     f"{entry['carried_uniform'] / e:.4f})")
        out.append(head)
        for name, k in entry["k"].items():
            out.append(f"[budget]   {name}: k {k}")
    return out
