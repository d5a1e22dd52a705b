"""Residual (error-feedback) memory with transactional steps.

Per layer it keeps ``residual`` r. ``compensate`` returns r + g in a spare
buffer; ``update`` then subtracts what the message carries from that buffer in place.
``commit`` makes the spare buffer the new residual; ``rollback`` drops it. So a
step that fails after compression (NaN on some rank, an exception in a
collective) leaves the residuals exactly as they were: nothing is lost.

Double buffering costs one extra layer-sized buffer but no allocation per step.

``compensate(..., scan=request)`` also makes the first pass of the selection that
follows while it writes r + g (CPU float32 with the native kernel), so on most steps
the selection does not read the layer again.

A bucket compressed at once (``compensate_bucket`` / ``update_bucket``) goes layer by layer,
unless its compressor asks for a ``BucketScan`` (exactly k by radix select, the GPU path):
then the bucket's residuals (and DGC velocities) are views of one flat double buffer, so
the compensation is one ``radix_select.compensate`` launch, fused with the selection's first
histogram, and the update one decode of the bucket's own message with alpha = -1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import radix_select as rs
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


@dataclass
class FlatPair:
    """One bucket's per-layer buffers (residuals or velocities) as views of one flat tensor,
    double-buffered like the per-layer ones: the step writes ``spare``, commit swaps."""
    cur: torch.Tensor
    spare: torch.Tensor
    cur_views: tuple
    spare_views: tuple

    def swap(self) -> None:
        self.cur, self.spare = self.spare, self.cur
        self.cur_views, self.spare_views = self.spare_views, self.cur_views


def flat_double_buffer(current: dict, spare: dict, flats: dict, key, names: list, sizes: list,
                       device) -> FlatPair:
    """The bucket's ``FlatPair``, with ``current[name]`` and ``spare[name]`` its views.

    1. First use: zeros. 2. A layer whose current buffer is not its view (first use, a
    restored checkpoint, a resize) has it copied in; zeros where it has none. 3. The spare
    views become the layers' spare buffers, for ``commit`` to swap in."""
    pair = flats.get(key)
    if pair is None or pair.cur.device != torch.device(device):
        n = sum(sizes)
        cur, new = (torch.zeros(n, dtype=torch.float32, device=device),
                    torch.empty(n, dtype=torch.float32, device=device))
        pair = flats[key] = FlatPair(cur, new, tuple(cur.split(sizes)), tuple(new.split(sizes)))
    for name, view in zip(names, pair.cur_views):
        held = current.get(name)
        if held is not view:
            if held is not None:
                view.copy_(held.reshape(-1))
            else:
                view.zero_()
            current[name] = view
    spare.update(zip(names, pair.spare_views))
    return pair


def flat_grad(buffers: dict, key, grads: list) -> torch.Tensor:
    """The unit's gradients back to back in one reused buffer, in their own dtype (fp16/bf16
    stay half: the compensation reads them), fp32 when they differ."""
    dtype = grads[0].dtype if all(g.dtype == grads[0].dtype for g in grads) else torch.float32
    n = sum(g.numel() for g in grads)
    buf = buffers.get(key)
    if buf is None or buf.dtype != dtype or buf.device != grads[0].device or buf.numel() != n:
        buf = buffers[key] = torch.empty(n, dtype=dtype, device=grads[0].device)
    return torch.cat([g.to(dtype) for g in grads], out=buf)


class NoMemory:
    """Methods without error feedback: x is the gradient itself and nothing is kept."""
    corrects_momentum = False

    def compensate(self, name: str, grad: torch.Tensor, scan: ScanRequest | None = None) -> torch.Tensor:
        return grad

    def compensate_bucket(self, layers, grads: list, scan=None) -> list:
        return list(grads)

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
        pass

    def update_bucket(self, layers, xs: list, messages: list, compressor, scan=None) -> None:
        pass

    def update_aggregate(self, name: str, x: torch.Tensor, average: torch.Tensor) -> None:
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
        self._grad_buffers: dict = {}

    def compensate(self, name: str, grad: torch.Tensor, scan: ScanRequest | None = None) -> torch.Tensor:
        """Return a buffer holding residual + grad; ``update`` then subtracts the sent part from it.
        ``scan``: filled with the selection's first pass over that buffer where it can be fused."""
        r, spare = self._buffers(name, grad)
        if not compensate_scan(r, grad, spare, scan, fuse=self.fuse):
            torch.add(r, grad, out=spare)
        self._pending[name] = spare
        return spare

    def compensate_bucket(self, layers, grads: list, scan=None) -> list:
        """x for every layer of a unit (one layer, or a bucket compressed together). ``scan``: one
        ``ScanRequest`` (or None) per layer, or a ``BucketScan``, which ``_compensate_flat`` fills."""
        if isinstance(scan, rs.BucketScan) and self._flat_velocity_ok(layers):
            return self._compensate_flat(layers, grads, scan)
        scans = scan if isinstance(scan, list) else [None] * len(layers)
        return [self.compensate(l.name, g, s) for l, g, s in zip(layers, grads, scans)]

    def _compensate_flat(self, layers, grads: list, scan) -> list:
        """1. the unit's gradients in one flat buffer; 2. its residuals as views of a flat double
        buffer; 3. one ``rs.compensate``: x = r + g (DGC: the velocity too), fused with the first
        histogram; 4. ``scan`` filled for the selection, the layers' views pending until commit."""
        names, sizes = [l.name for l in layers], [l.numel for l in layers]
        g = flat_grad(self._grad_buffers, tuple(names), grads)                               # 1.
        r = flat_double_buffer(self.residual, self._spare, self._flats, ("r", tuple(names)), names, sizes,
                               g.device)                                                     # 2.
        velocity = self._flat_velocity(names, sizes, g.device, scan)
        scan.hist = rs.compensate(scan.seg, r.cur, g, r.spare, sign=scan.sign, backend=scan.backend,
                                  **velocity)                                                # 3.
        scan.x = r.spare                                                                     # 4.
        self._pending.update(zip(names, r.spare_views))
        self._pending_flats.append(r)
        return list(r.spare_views)

    def _flat_velocity_ok(self, layers) -> bool:
        """Whether one compensate call can serve these layers (one momentum for all of them)."""
        return True

    def _flat_velocity(self, names: list, sizes: list, device, scan) -> dict:
        """The velocity arguments of ``rs.compensate`` (DGC's memory); none here."""
        return {}

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
        """x (this step's compensated buffer) -= what receivers will decode from ``message``:
        quantisation error stays in the residual."""
        compressor.decompress_add(x, message.tensors, layer, alpha=-1.0, ctx=message.ctx)
        self.mask(layer.name, message.positions)

    def update_bucket(self, layers, xs: list, messages: list, compressor, scan=None) -> None:
        """``update`` for every layer of a unit; a bucket compensated flat is updated by one decode
        of its own bucket message with alpha = -1 (the receivers' code, as ``update`` runs it),
        which also zeroes the step's velocity where values were sent (masking)."""
        if not (isinstance(scan, rs.BucketScan) and scan.x is not None):
            for layer, x, msg in zip(layers, xs, messages):
                self.update(layer, x, msg, compressor)
            return
        own = [compressor.bucket_tensors(layers, messages)]
        compressor.decompress_bucket({l.name: x for l, x in zip(layers, xs)}, own, layers, alpha=-1.0,
                                     flat=scan.x, zero=scan.velocity)

    def update_aggregate(self, name: str, x: torch.Tensor, average: torch.Tensor) -> None:
        """x -= the decoded average of every rank's message (PowerSGD's error feedback)."""
        x.sub_(average)

    def mask(self, name: str, positions) -> None:
        """Hook for memories that react to which positions were sent (momentum masking)."""

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
