"""Residual (error-feedback) memory with transactional steps.

Per layer it keeps ``residual`` r. ``compensate`` returns r + g in a spare
buffer; the compressor then subtracts what it sent from that buffer in place.
``commit`` makes the spare buffer the new residual; ``rollback`` drops it. So a
step that fails after compression (NaN on some rank, an exception in a
collective) leaves the residuals exactly as they were: nothing is lost.

Double buffering costs one extra layer-sized buffer but no allocation per step.

``compensate(..., scan=request)`` also makes the first pass of the selection that
follows while it writes r + g (CPU float32 with the native kernel), so on most steps
the selection does not read the layer again.
"""
from __future__ import annotations

import torch

from ..core.passes import ScanRequest, compensate_scan


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


class ResidualMemory:
    """Dense layers never pass through a memory: they send everything, so a residual
    would stay zero."""

    def mask(self, name: str, indices) -> None:
        """Hook for memories that react to which positions were sent (momentum masking)."""

    def __init__(self) -> None:
        self.residual: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def compensate(self, name: str, grad: torch.Tensor, scan: ScanRequest | None = None) -> torch.Tensor:
        """Return a buffer holding residual + grad; the caller subtracts the sent part from it.
        ``scan``: filled with the selection's first pass over that buffer where it can be fused."""
        r, spare = self._buffers(name, grad)
        if not compensate_scan(r, grad, spare, scan):
            torch.add(r, grad, out=spare)
        self._pending[name] = spare
        return spare

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
