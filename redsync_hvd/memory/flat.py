"""Memories kept flat, and the one object an exchange keeps its memories through.

* :class:`FlatPair`: a buffer carried between steps and the spare one a step writes, swapped on
  commit (a planned bucket's residuals and velocities, an FSDP group's, ``exchange/sharded.py``);
* :class:`FlatMemory`: a planned bucket's residuals and DGC velocities, per-layer views of flat
  double buffers laid out by the bucket's frame (``exchange/planned.py``);
* :class:`Memories`: the per-layer memory (``residual.py``, ``momentum.py``) and every flat one,
  as one: the learning-rate follow, commit, rollback, the finite clean-up, the residuals by layer
  name and one ``state_dict`` in the per-layer memory's format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.segments import Segments


@dataclass
class FlatPair:
    """Per-layer buffers (residuals or velocities) as views of one flat tensor, double-buffered:
    the step writes ``spare``; ``swap`` on commit makes it current. Padding stays zero in both."""
    cur: torch.Tensor
    spare: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, dtype, device) -> "FlatPair":
        return cls(*(torch.zeros(numel, dtype=dtype, device=device) for _ in range(2)))

    def swap(self) -> None:
        self.cur, self.spare = self.spare, self.cur


class FlatMemory:
    """A planned bucket's residuals (``residual``) and DGC velocities (``momentum`` not None), laid out
    by the bucket's frame. A step writes the spare halves; ``commit`` swaps them in, ``rollback``
    leaves them, so a failed step loses nothing. Saved and restored per layer name, in the format
    of ``memory/residual.py``'s ``state_dict`` (:class:`Memories` merges the two)."""

    def __init__(self, names: list, frame: Segments, *, residual: bool, momentum: float | None = None,
                 nesterov: bool = False, masking: bool = True):
        self.names, self.frame = names, frame
        self.residual, self.momentum, self.nesterov, self.masking = residual, momentum, nesterov, masking
        self.pairs: dict = {}        # "r" / "u" -> FlatPair
        self.loaded: dict = {}       # what a checkpoint held, copied in when the buffers are made
        self.written = False

    def ready(self, device) -> None:
        if self.pairs and self.pairs["r"].cur.device == torch.device(device):
            return
        kinds = (["r"] if self.residual else []) + (["u"] if self.momentum is not None else [])
        for kind in kinds:
            pair = FlatPair.zeros(self.frame.n, torch.float32, device)
            for view, name in zip(self.frame.views(pair.cur), self.names):
                held = self.loaded.get(kind, {}).get(name)
                if held is not None:
                    view.copy_(held.reshape(-1))
            self.pairs[kind] = pair

    def state(self, kind: str) -> dict:
        pair = self.pairs.get(kind)
        if pair is None:
            return {n: t.clone() for n, t in self.loaded.get(kind, {}).items()}
        return {n: v.detach().clone() for n, v in zip(self.names, self.frame.views(pair.cur))}

    def load(self, residual: dict, velocity: dict) -> None:
        """Take this bucket's layers out of a checkpoint's dicts (the rest is the memory's)."""
        self.loaded = {"r": {n: residual.pop(n) for n in self.names if n in residual},
                       "u": {n: velocity.pop(n) for n in self.names if n in velocity}}
        device = self.pairs["r"].cur.device if self.pairs else None
        self.pairs = {}
        if device is not None:
            self.ready(device)

    def scale(self, factor: float) -> None:
        for pair in self.pairs.values():
            pair.cur.mul_(factor)

    def commit(self) -> None:
        if self.written:
            for pair in self.pairs.values():
                pair.swap()
        self.written = False

    def rollback(self) -> None:
        self.written = False

    def keep_finite(self) -> None:
        """Zero what is not finite in this step's (spare) halves: a step that passed NaN on
        (``check_finite: false``) must not leave it in what outlives the step."""
        if self.written:
            for pair in self.pairs.values():
                torch.nan_to_num_(pair.spare, nan=0.0, posinf=0.0, neginf=0.0)


class Memories:
    """The per-layer memory and the flat ones of an exchange's planned buckets, kept as one."""

    def __init__(self, layers, flats: list):
        self.layers, self.flats = layers, list(flats)

    def scale(self, factor: float) -> None:
        """Multiply everything carried by ``factor`` (the learning rate moved from a to b: a / b)."""
        self.layers.scale(factor)
        for m in self.flats:
            m.scale(factor)

    def settle(self, commit: bool, passed: bool = False) -> None:
        """Keep this step (commit) or forget it; a step that passed NaN on keeps it with what is not
        finite zeroed."""
        for m in [self.layers] + self.flats:
            if passed:
                m.keep_finite()
            if commit:
                m.commit()
            else:
                m.rollback()

    def residuals(self, kind: str = "residual") -> dict:
        """{name: current residual} (``kind`` "velocity": DGC's velocities) wherever it lives."""
        out = dict(getattr(self.layers, kind, {}))
        pair = "r" if kind == "residual" else "u"
        for m in self.flats:
            if pair in m.pairs:
                out.update(zip(m.names, m.frame.views(m.pairs[pair].cur)))
        return out

    def state_dict(self) -> dict:
        out = self.layers.state_dict()
        for m in self.flats:
            out.setdefault("residual", {}).update(m.state("r"))
            if m.momentum is not None:
                out.setdefault("velocity", {}).update(m.state("u"))
        return out

    def load_state_dict(self, state: dict) -> None:
        """Each flat memory takes its layers out of the saved dicts; the per-layer memory the rest."""
        state = dict(state)
        residual, velocity = dict(state.get("residual", {})), dict(state.get("velocity", {}))
        for m in self.flats:
            m.load(residual, velocity)
        self.layers.load_state_dict({**state, "residual": residual, "velocity": velocity})
