"""Residual (error-feedback) memory with transactional steps.

Per layer it keeps ``residual`` r. ``compensate`` returns r + g in a spare buffer (with
what the selection wants from that pass, see :class:`Compensated`); ``update`` then
subtracts what the message carries from that buffer in place. ``commit`` makes the spare
buffer the new residual; ``rollback`` drops it. So a step that fails after compression
(NaN on some rank, an exception in a collective) leaves the residuals exactly as they
were: nothing is lost.

Double buffering costs one extra layer-sized buffer but no allocation per step.

A bucket compressed at once on the device (``compensate_flat`` / ``update_flat``: exactly k
per layer by radix select, the GPU path) keeps its residuals (and DGC velocities) as views
of one flat double buffer laid out by the bucket's ``Segments``, so the compensation is one
``radix_select.compensate`` launch, fused with the selection's first histogram.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..core import radix_select as rs
from ..core.passes import Compensated, ScanRequest, compensate_scan


def double_buffer(current: dict, spare: dict, name: str, like: torch.Tensor):
    """(``current[name]``, zeros on first use; ``spare[name]``, a buffer of the same shape that
    ``commit`` swaps in): the step writes into the spare, so a failed step loses nothing."""
    cur = current.get(name)
    if cur is None:
        cur = current[name] = torch.zeros_like(like, dtype=torch.float32)
    new = spare.get(name)
    if new is None or new.shape != cur.shape or new.device != cur.device:
        new = spare[name] = torch.empty_like(cur)
    return cur, new


@dataclass
class FlatPair:
    """One bucket's per-layer buffers (residuals or velocities) as views of one flat tensor,
    double-buffered like the per-layer ones: the step writes ``spare``, commit swaps. Padding
    between layers (``Segments`` alignment) stays zero in both."""
    cur: torch.Tensor
    spare: torch.Tensor
    cur_views: tuple
    spare_views: tuple

    def swap(self) -> None:
        self.cur, self.spare = self.spare, self.cur
        self.cur_views, self.spare_views = self.spare_views, self.cur_views


def layer_views(flat: torch.Tensor, seg) -> tuple:
    """Each layer's slice of a flat buffer laid out by ``seg`` (``seg.offsets``, ``seg.sizes``)."""
    return tuple(flat[o:o + n] for o, n in zip(seg.offsets, seg.sizes))


def flat_double_buffer(current: dict, spare: dict, flats: dict, key, names: list, seg, device) -> FlatPair:
    """The bucket's ``FlatPair``, with ``current[name]`` and ``spare[name]`` its views.

    1. First use: zeros. 2. A layer whose current buffer is not its view (first use, a
    restored checkpoint, a resize) has it copied in; zeros where it has none. 3. The spare
    views become the layers' spare buffers, for ``commit`` to swap in."""
    pair = flats.get(key)
    if pair is None or pair.cur.device != torch.device(device) or pair.cur.numel() != seg.n:
        cur = torch.zeros(seg.n, dtype=torch.float32, device=device)                       # 1.
        new = torch.zeros(seg.n, dtype=torch.float32, device=device)
        pair = flats[key] = FlatPair(cur, new, layer_views(cur, seg), layer_views(new, seg))
    for name, view in zip(names, pair.cur_views):                                          # 2.
        held = current.get(name)
        if held is not view:
            if held is not None:
                view.copy_(held.reshape(-1))
            else:
                view.zero_()
            current[name] = view
    spare.update(zip(names, pair.spare_views))                                              # 3.
    return pair


@dataclass
class FlatStep:
    """A flat bucket's buffers for one step: the residual pair, and DGC's velocity pair with its
    momentum, Nesterov flag and masking where the memory keeps one."""
    residual: FlatPair
    velocity: Optional[FlatPair] = None
    momentum: float = 0.0
    nesterov: bool = False
    masking: bool = False


class NoMemory:
    """Methods without error feedback: x is the gradient itself and nothing is kept."""
    corrects_momentum = False

    def compensate(self, name: str, grad: torch.Tensor, want: ScanRequest | None = None) -> Compensated:
        return Compensated(grad)

    def flat_step(self, names: list, seg, device) -> None:
        return None

    def compensate_flat(self, fs, seg, grad: torch.Tensor, want) -> Compensated:
        return Compensated(grad.float())

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
        pass

    def update_flat(self, layers, c: Compensated, message, compressor) -> None:
        pass

    def update_aggregate(self, name: str, x: torch.Tensor, average: torch.Tensor) -> None:
        pass

    def keep_finite(self) -> None:
        pass

    def scale(self, factor: float) -> None:
        pass

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ResidualMemory:
    """Error feedback. Dense layers never pass through a memory: they send everything, so a
    residual would stay zero."""
    corrects_momentum = False   # True: dense layers' averages get momentum (dense_momentum)

    def __init__(self, fuse: bool = True) -> None:
        self.fuse = fuse   # compensate and the selection's first pass in one native pass (CPU)
        self.residual: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._flats: dict = {}            # (kind, layer names) -> FlatPair: buckets kept flat
        self._pending_flats: list = []    # their pairs written this step, swapped on commit

    def compensate(self, name: str, grad: torch.Tensor, want: ScanRequest | None = None) -> Compensated:
        """x = residual + grad in a spare buffer; ``update`` then subtracts the sent part from it.
        ``want``: the selection's first pass, made in the same pass where the native kernel can."""
        r, spare = self._buffers(name, grad)
        scan = compensate_scan(r, grad, spare, want, fuse=self.fuse)
        if scan is None:
            torch.add(r, grad, out=spare)
        self._pending[name] = spare
        return Compensated(spare, scan if want is not None else None)

    def flat_step(self, names: list, seg, device) -> FlatStep:
        """The buffers a bucket compressed flat reads and writes this step (host bookkeeping only:
        a step replayed from a CUDA graph makes this call and replays the device work, which
        ``compensate_flat`` and ``update_flat`` do): 1. its residuals as views of a flat double
        buffer laid out by ``seg``; 2. DGC's velocities likewise (``MomentumCorrectionMemory``);
        3. the spare views pending until commit."""
        r = flat_double_buffer(self.residual, self._spare, self._flats, ("r", tuple(names)), names, seg, device)  # 1.
        velocity = self._flat_velocity(names, seg, device)                                               # 2.
        self._pending.update(zip(names, r.spare_views))                                                  # 3.
        self._pending_flats.append(r)
        return FlatStep(r, *velocity)

    def compensate_flat(self, fs: FlatStep, seg, grad: torch.Tensor, want: rs.BucketRequest) -> Compensated:
        """x = r + g over the bucket (DGC: the velocity too) in one ``rs.compensate``, fused with the
        selection's first histogram; the step's velocity comes along, to be masked."""
        u = fs.velocity
        extra = {} if u is None else {"velocity": u.cur, "velocity_out": u.spare, "momentum": fs.momentum,
                                      "nesterov": fs.nesterov}
        hist = rs.compensate(seg, fs.residual.cur, grad, fs.residual.spare, sign=want.sign, backend=want.backend,
                             **extra)
        return Compensated(fs.residual.spare, hist, u.spare if u is not None and fs.masking else None)

    def _flat_velocity(self, names: list, seg, device) -> tuple:
        """(velocity pair, momentum, nesterov, masking) of a bucket kept flat; none here."""
        return ()

    def flat_ok(self, layers) -> bool:
        """Whether one compensate call can serve these layers (one momentum for all of them)."""
        return True

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
        """x (this step's compensated buffer) -= what receivers will decode from ``message``:
        quantisation error stays in the residual."""
        compressor.decompress_add(x, message.tensors, layer, alpha=-1.0, ctx=message.ctx)
        self.mask(layer.name, message.positions)

    def update_flat(self, layers, c: Compensated, message, compressor) -> None:
        """``update`` for a bucket compressed flat: nothing when the compressor subtracted what it
        sent while it wrote the message (``message.updated``), else one decode of the bucket's own
        message with alpha = -1, zeroing the step's velocity there (masking)."""
        if not message.updated:
            compressor.decompress_bucket(None, [message.tensors], layers, alpha=-1.0, flat=c.x, zero=c.velocity)

    def update_aggregate(self, name: str, x: torch.Tensor, average: torch.Tensor) -> None:
        """x -= the decoded average of every rank's message (PowerSGD's error feedback)."""
        x.sub_(average)

    def mask(self, name: str, positions) -> None:
        """Hook for memories that react to which positions were sent (momentum masking)."""

    def keep_finite(self) -> None:
        """Zero what is not finite in this step's pending buffers: a step that passed NaN/Inf on
        (``check_finite: false``) must not leave it in state that outlives the step, or every later
        step would send it again. One pass over them, on such steps only."""
        for pending in self._pending_buffers():
            for buf in pending.values():
                torch.nan_to_num_(buf, nan=0.0, posinf=0.0, neginf=0.0)

    def _pending_buffers(self) -> list:
        return [self._pending]

    def scale(self, factor: float) -> None:
        """Multiply what is carried (residuals; DGC's velocities too) by ``factor``, in place: the
        learning rate changed from a to b and ``factor`` = a / b keeps it worth the same update."""
        for buffers in self._carried():
            torch._foreach_mul_(list(buffers.values()), factor)

    def _carried(self) -> list:
        return [self.residual]

    def _buffers(self, name: str, grad: torch.Tensor):
        return double_buffer(self.residual, self._spare, name, grad)

    def commit(self) -> None:
        for name, buf in self._pending.items():
            self._spare[name], self.residual[name] = self.residual[name], buf
        self._pending.clear()
        for pair in self._pending_flats:
            pair.swap()
        self._pending_flats.clear()

    def rollback(self) -> None:
        self._pending.clear()
        self._pending_flats.clear()

    def state_dict(self) -> dict:
        return {"residual": {k: v.detach().clone() for k, v in self.residual.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.residual = {k: v.detach().clone().float() for k, v in state["residual"].items()}
        self._spare.clear()
        self._pending.clear()
        self._flats.clear()
        self._pending_flats.clear()
