"""Residual (error-feedback) memory with transactional steps.

Per layer it keeps ``residual`` r. ``compensate`` returns r + g in a spare buffer (with
what the selection wants from that pass, see :class:`Compensated`); ``update`` then
subtracts what the message carries from that buffer in place. ``commit`` makes the spare
buffer the new residual; ``rollback`` drops it. So a step that fails after compression
(NaN on some rank, an exception in a collective) leaves the residuals exactly as they
were: nothing is lost.

Double buffering costs one extra layer-sized buffer but no allocation per step.

A bucket kept flat on the device (exactly k per layer: ``exchange/planned.py``) keeps its
residuals and velocities itself, as views of flat double buffers; ``flat_terms`` says what it
needs to keep for its layers.
"""
from __future__ import annotations

import torch

from ..core.select import Compensated, ScanRequest, compensate


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


class NoMemory:
    """Methods without error feedback: x is the gradient itself and nothing is kept."""
    corrects_momentum = False
    keeps = False

    def compensate(self, name: str, grad: torch.Tensor, want: ScanRequest | None = None) -> Compensated:
        return Compensated(grad)

    def flat_terms(self, names: list) -> dict:
        return {"residual": False}

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
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
    keeps = True

    def __init__(self, fuse: bool = True) -> None:
        self.fuse = fuse   # compensate and the selection's first pass in one native pass (CPU)
        self.residual: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor, want: ScanRequest | None = None) -> Compensated:
        """x = residual + grad in a spare buffer; ``update`` then subtracts the sent part from it.
        ``want``: the selection's first pass, made in the same pass where the native kernel can."""
        r, spare = self._buffers(name, grad)
        first = compensate(r, grad, spare, first=want, fuse=self.fuse)
        self._pending[name] = spare
        return Compensated(spare, first)

    def flat_terms(self, names: list) -> dict | None:
        """What a bucket kept flat keeps for ``names`` (``memory/flat.py``: ``FlatMemory``'s
        arguments), or None where one flat compensation cannot serve them all."""
        return {"residual": True}

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
        """x (this step's compensated buffer) -= what receivers will decode from ``message``:
        quantisation error stays in the residual."""
        compressor.decompress_add(x, message.tensors, layer, alpha=-1.0, ctx=message.ctx)
        self.mask(layer.name, message.positions)

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

    def rollback(self) -> None:
        self._pending.clear()

    def state_dict(self) -> dict:
        return {"residual": {k: v.detach().clone() for k, v in self.residual.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.residual = {k: v.detach().clone().float() for k, v in state["residual"].items()}
        self._spare.clear()
        self._pending.clear()
