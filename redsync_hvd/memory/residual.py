"""Residual (error-feedback) memory with transactional steps.

Per layer it keeps ``residual`` r. ``compensate`` returns r + g in a spare buffer (with
what the selection wants from that pass, see :class:`Compensated`); ``update`` then
subtracts what the message carries from that buffer in place. ``commit`` makes the spare
buffer the new residual; ``rollback`` drops it. So a step that fails after compression
(NaN on some rank, an exception in a collective) leaves the residuals exactly as they
were: nothing is lost.

What is carried lives in the memory's :class:`~.state.Carried` (``state``): the residuals of
this memory's layers and, as flat blocks, those of the buckets kept flat on the device
(exactly k per layer: ``exchange/planned.py``, which takes its block from ``state``;
``flat_terms`` says what it keeps for its layers). One commit, rollback and ``state_dict``
serve all of them.
"""
from __future__ import annotations

import torch

from ..core.select import Compensated, ScanRequest, compensate
from .state import Carried


class NoMemory:
    """Methods without error feedback: x is the gradient itself and nothing is kept."""
    corrects_momentum = False

    def compensate(self, name: str, grad: torch.Tensor, want: ScanRequest | None = None) -> Compensated:
        return Compensated(grad)

    def flat_terms(self, names: list) -> dict:
        return {"residual": False}

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
        pass

    def update_aggregate(self, name: str, x: torch.Tensor, average: torch.Tensor) -> None:
        pass

    def give_back(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        pass

    def keep_finite(self) -> None:
        pass

    def scale(self, factor: float) -> None:
        pass

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def residuals(self, kind: str = "residual") -> dict:
        return {}

    def drop(self, names: list) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ResidualMemory:
    """Error feedback. Dense layers never pass through a memory: they send everything, so a
    residual would stay zero."""
    corrects_momentum = False   # True: dense layers' averages get momentum (dense_momentum)
    KINDS: tuple = ("residual",)     # what ``state`` carries per layer (its state_dict names them)
    COUNTERS: tuple = ()

    def __init__(self, fuse: bool = True) -> None:
        self.fuse = fuse   # compensate and the selection's first pass in one native pass (CPU)
        self.state = Carried(self.KINDS, self.COUNTERS)

    @property
    def residual(self) -> dict:
        """{name: current residual} of the layers this memory compensates (not the flat blocks')."""
        return self.state.cur["residual"]

    def compensate(self, name: str, grad: torch.Tensor, want: ScanRequest | None = None) -> Compensated:
        """x = residual + grad in a spare buffer; ``update`` then subtracts the sent part from it.
        ``want``: the selection's first pass, made in the same pass where the native kernel can."""
        r, spare = self.state.pair("residual", name, grad)
        return Compensated(spare, compensate(r, grad, spare, first=want, fuse=self.fuse))

    def flat_terms(self, names: list) -> dict | None:
        """What a bucket kept flat keeps for ``names`` (the kinds and DGC's terms of its block in
        ``state``), or None where one flat compensation cannot serve them all."""
        return {"residual": True}

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
        """x (this step's compensated buffer) -= what receivers will decode from ``message``:
        quantisation error stays in the residual."""
        compressor.decompress_add(x, message.tensors, layer, alpha=-1.0, ctx=message.ctx)
        self.mask(layer.name, message.positions)

    def update_aggregate(self, name: str, x: torch.Tensor, average: torch.Tensor) -> None:
        """x -= the decoded average of every rank's message (PowerSGD's error feedback)."""
        x.sub_(average)

    def give_back(self, name: str, positions: torch.Tensor, values: torch.Tensor) -> None:
        """This step's residual of ``name`` += values at positions: what a rank sent and no owner
        kept (the sparse reduce-scatter, ``exchange/scatter.py``), pending with the step."""
        x = self.state.pending("residual", name)
        if x is not None and positions.numel():
            x.index_add_(0, positions.to(x.device), values.to(x))

    def mask(self, name: str, positions) -> None:
        """Hook for memories that react to which positions were sent (momentum masking)."""

    def keep_finite(self) -> None:
        """Zero what is not finite in this step's buffers (``Carried.keep_finite``)."""
        self.state.keep_finite()

    def scale(self, factor: float) -> None:
        """Multiply what is carried (residuals; DGC's velocities too) by ``factor``, in place: the
        learning rate changed from a to b and ``factor`` = a / b keeps it worth the same update."""
        self.state.scale(factor)

    def commit(self) -> None:
        self.state.commit()

    def rollback(self) -> None:
        self.state.rollback()

    def residuals(self, kind: str = "residual") -> dict:
        """{name: current residual} (``kind`` "velocity": DGC's velocities), flat blocks' layers too."""
        return self.state.current(kind)

    def drop(self, names: list) -> None:
        """Forget what is carried for ``names`` (they travel dense from now on), and the flat
        blocks back to layers of their own: the exchange's buckets are built again
        (``exchange/redecide.py:rebuild``) and the new planned ones take their layers' share."""
        self.state.unblock()
        self.state.forget(names)

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)
