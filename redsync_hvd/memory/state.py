"""What error feedback carries from step to step on this worker, in one place: :class:`Carried`.

Kinds: ``residual`` (r), ``velocity`` (DGC's u), ``exp_avg`` and ``exp_avg_sq`` (a worker's own
Adam moments, ``adam.py``), ``dense_velocity`` (an FSDP group's dense parameters' u). Each is kept
per layer name, either as a tensor of its own or as a view of a flat block: the buffers of a
planned bucket (``exchange/planned.py``, laid out by its frame) or of an FSDP group
(``exchange/sharded.py``, its rows), which the kernels read and write as one tensor.

Double-buffered, one transaction for all of it: a step writes spare buffers (``pair``; a block's
``spare`` halves, marking it ``written``), and only ``commit`` makes them current; ``rollback``
drops them, so a step that fails (NaN on some rank, an exception in a collective) loses nothing.
Integer counters (Adam's steps per layer) follow the same transaction. ``state_dict`` holds every
kind by layer name, the blocks' layers included: the format checkpoints have always had.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..core.segments import Segments


@dataclass
class Pair:
    """A carried tensor and the spare one a step writes (a record of :class:`Carried`)."""
    cur: torch.Tensor
    spare: torch.Tensor


@dataclass
class Block:
    """Flat double buffers of several layers (a record of :class:`Carried`): ``pairs[kind]``; with
    ``names`` and ``frame``, layer i's part is ``frame.views(...)[i]``. ``written``: this step
    wrote the spare halves (set by whoever runs the step); ``commit`` swaps only those."""
    pairs: dict
    names: Optional[list] = None
    frame: Optional[Segments] = None
    written: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


class Carried:
    """Every carried tensor of this worker; see the module docstring. ``kinds``: the kinds a
    ``state_dict`` always names (empty or not), ``counters``: the counters it names."""

    def __init__(self, kinds: tuple = ("residual",), counters: tuple = ()):
        self.kinds, self.counter_names = tuple(kinds), tuple(counters)
        self.cur: dict = {k: {} for k in self.kinds}       # kind -> {name: tensor}
        self._spare: dict = {}                             # kind -> {name: the other buffer}
        self._pending: dict = {}                           # kind -> {name: this step's buffer}
        self.blocks: dict = {}                             # key -> Block
        self.counters: dict = {c: {} for c in self.counter_names}
        self._counted: dict = {}                           # counter -> names to step on commit

    # -- per layer ---------------------------------------------------------------------------
    def pair(self, kind: str, name: str, like: torch.Tensor):
        """(the carried tensor, zeros of ``like``'s shape on first use; the spare buffer this step
        writes, which ``commit`` makes current)."""
        current = self.cur.setdefault(kind, {})
        cur = current.get(name)
        if cur is None:
            cur = current[name] = torch.zeros_like(like, dtype=torch.float32)
        spare = self._spare.setdefault(kind, {})
        new = spare.get(name)
        if new is None or new.shape != cur.shape or new.device != cur.device:
            new = spare[name] = torch.empty_like(cur)
        self._pending.setdefault(kind, {})[name] = new
        return cur, new

    def pending(self, kind: str, name: str) -> Optional[torch.Tensor]:
        """This step's buffer of ``kind`` for ``name`` (written by ``pair``), or None."""
        return self._pending.get(kind, {}).get(name)

    def written(self, kind: str) -> set:
        """The names whose ``kind`` this step wrote (``pair``)."""
        return set(self._pending.get(kind, {}))

    def count(self, counter: str, names) -> None:
        """Step ``counter`` by one for each of ``names`` when this step commits."""
        self._counted.setdefault(counter, set()).update(names)

    # -- flat blocks -------------------------------------------------------------------------
    def block(self, key, sizes: dict, dtypes: dict, device, names: Optional[list] = None,
              frame: Optional[Segments] = None) -> Block:
        """The flat double buffers ``key`` holds, one per kind (``sizes[kind]`` elements of
        ``dtypes[kind]``), made on first use or on another device; a block with ``names`` and
        ``frame`` takes its layers' carried tensors into its views: what it carried on the other
        device, else what a checkpoint held (or ``unblock`` left)."""
        blk = self.blocks.get(key)
        if blk is not None and blk.device == torch.device(device):
            return blk
        pairs = {kind: Pair(*(torch.zeros(n, dtype=dtypes[kind], device=device) for _ in range(2)))
                 for kind, n in sizes.items()}
        if names is not None:
            for kind, pair in pairs.items():
                moved = blk is not None and kind in blk.pairs
                held = frame.views(blk.pairs[kind].cur) if moved else \
                    [self.cur.get(kind, {}).pop(name, None) for name in names]
                for view, t in zip(frame.views(pair.cur), held):
                    if t is not None:
                        view.copy_(t.reshape(-1))
        blk = self.blocks[key] = Block(pairs, names, frame, device=torch.device(device))
        return blk

    def unblock(self) -> None:
        """Every named block's layers back to tensors of their own, the blocks dropped (the
        exchange's buckets are built again: new blocks take their layers on their next use)."""
        for key, blk in list(self.blocks.items()):
            if blk.names is None:
                continue
            for kind, p in blk.pairs.items():
                self.cur.setdefault(kind, {}).update(
                    (n, v.detach().clone()) for n, v in zip(blk.names, blk.frame.views(p.cur)))
            del self.blocks[key]

    def forget(self, names) -> None:
        """Drop what is carried for ``names``, counters too (layers that travel dense from now on:
        nothing of theirs is read again)."""
        for table in [*self.cur.values(), *self._spare.values(), *self.counters.values()]:
            for name in names:
                table.pop(name, None)

    # -- the transaction ---------------------------------------------------------------------
    def commit(self) -> None:
        for kind, pending in self._pending.items():
            current, spare = self.cur.setdefault(kind, {}), self._spare.setdefault(kind, {})
            for name, buf in pending.items():
                spare[name], current[name] = current.get(name), buf
            pending.clear()
        for blk in self.blocks.values():
            if blk.written:
                for p in blk.pairs.values():
                    p.cur, p.spare = p.spare, p.cur
            blk.written = False
        for counter, names in self._counted.items():
            steps = self.counters.setdefault(counter, {})
            for name in names:
                steps[name] = steps.get(name, 0) + 1
        self._counted.clear()

    def rollback(self) -> None:
        for pending in self._pending.values():
            pending.clear()
        for blk in self.blocks.values():
            blk.written = False
        self._counted.clear()

    def keep_finite(self) -> None:
        """Zero what is not finite in this step's buffers: a step that passed NaN/Inf on
        (``check_finite: false``) must not leave it in what outlives the step, or every later step
        would send it again. One pass over them, on such steps only."""
        bufs = [b for pending in self._pending.values() for b in pending.values()]
        bufs += [p.spare for blk in self.blocks.values() if blk.written for p in blk.pairs.values()]
        for buf in bufs:
            torch.nan_to_num_(buf, nan=0.0, posinf=0.0, neginf=0.0)

    def scale(self, factor: float, kinds=("residual", "velocity")) -> None:
        """Multiply what is carried of ``kinds`` by ``factor``, in place: the learning rate changed
        from a to b and ``factor`` = a / b keeps it worth the same update."""
        bufs = [t for kind in kinds for t in self.cur.get(kind, {}).values()]
        bufs += [p.cur for blk in self.blocks.values() for kind, p in blk.pairs.items() if kind in kinds]
        if bufs:
            torch._foreach_mul_(bufs, factor)

    # -- by layer name -----------------------------------------------------------------------
    def current(self, kind: str) -> dict:
        """{name: the carried tensor of ``kind``}, the blocks' layers as views."""
        out = dict(self.cur.get(kind, {}))
        for blk in self.blocks.values():
            if blk.names is not None and kind in blk.pairs:
                out.update(zip(blk.names, blk.frame.views(blk.pairs[kind].cur)))
        return out

    def state_dict(self) -> dict:
        """{kind: {name: tensor}} for every kind this state names, then {counter: {name: int}}."""
        out = {kind: {n: t.detach().clone() for n, t in self.current(kind).items()} for kind in self.kinds}
        out.update({c: dict(self.counters.get(c, {})) for c in self.counter_names})
        return out

    def load_state_dict(self, state: dict) -> None:
        """Take a ``state_dict`` (of the kinds and counters this state names); the blocks of named
        layers are made again from it on their next use."""
        for kind in self.kinds:
            self.cur[kind] = {n: t.detach().clone().float() for n, t in (state.get(kind) or {}).items()}
        for c in self.counter_names:
            self.counters[c] = {n: int(v) for n, v in (state.get(c) or {}).items()}
        self._spare.clear()
        self.rollback()
        self.blocks = {key: blk for key, blk in self.blocks.items() if blk.names is None}
