"""DGC's momentum correction and factor masking on top of the residual.

Plain momentum SGD applied after sparse averaging would apply momentum to a
sparse, delayed signal and drift. DGC instead keeps, per worker and layer,
a velocity u and accumulates it into the residual v:

    u = m*u + g                 (nesterov: v += g + m*u, else v += u)
    send part of v;  v[sent] -= what was sent
    u[sent] = 0                 (momentum factor masking: stale velocity stops pushing)

Masking has a price: a coordinate sent every tau steps keeps only
1 - m(1 - m^tau)/((1 - m) tau) of dense momentum's step (1 - m, plain SGD, at
tau = 1). ``masking="stale"`` masks only where the value sent had waited
longer than 1/(1 - m) steps, read as |v| > |u|/(1 - m) at the position (under
a steady gradient v holds about tau times u): what waited long stops pushing,
what is sent every few steps keeps its momentum.

The wrapped optimizer then takes a plain SGD step on the average of what was
sent: its own momentum must be 0 (the DistributedOptimizer takes it out).

Layers sent dense would send all of v every step, so their residual would stay
zero and the average of the ranks' velocities is the velocity of the averaged
gradient (momentum is linear). So they skip this memory on the way out, travel
as plain gradients, and ``dense_momentum`` applies u = m*u + avg to their
averages afterwards, all of them in one batched update: no residual buffers
and no per-layer passes for them.

Like :class:`ResidualMemory`, updates go to spare buffers and only ``commit``
makes them current, so a failed step leaves u and v untouched.
"""
from __future__ import annotations

import torch

from ..core.compensate import velocity as dgc_velocity
from ..core.select import Compensated, ScanRequest, compensate
from .residual import ResidualMemory


class MomentumCorrectionMemory(ResidualMemory):
    corrects_momentum = True
    KINDS = ("residual", "velocity")

    def __init__(self, momentum: dict | float, nesterov: bool = False, masking: bool = True, fuse: bool = True):
        super().__init__(fuse)
        self.momentum = momentum          # float, or {layer name: momentum} from the param groups
        self.nesterov = nesterov
        self.masking = masking

    @property
    def velocity(self) -> dict:
        """{name: current velocity} of the layers this memory compensates."""
        return self.state.cur["velocity"]

    def _m(self, name: str) -> float:
        return self.momentum.get(name, 0.0) if isinstance(self.momentum, dict) else self.momentum

    def compensate(self, name: str, grad: torch.Tensor, want: ScanRequest | None = None) -> Compensated:
        m = self._m(name)
        u, u_new = self.state.pair("velocity", name, grad)
        v, v_new = self.state.pair("residual", name, grad)
        # u = m*u + g; v + u: one pass over g, u and v where the native kernel runs, torch ops make three
        first = compensate(v, grad, v_new, velocity=u, velocity_out=u_new, momentum=m, nesterov=self.nesterov,
                           first=want, fuse=self.fuse)
        return Compensated(v_new, first)                 # v + step, in v's spare buffer

    def flat_terms(self, names: list) -> dict | None:
        """A bucket kept flat keeps velocities too, with one momentum for all its layers (the
        kernel takes one); None where their momenta differ."""
        momenta = {self._m(n) for n in names}
        if len(momenta) != 1 or self.masking == "stale":   # the flat kernels mask every position sent
            return None
        return {"residual": True, "momentum": momenta.pop(), "nesterov": self.nesterov, "masking": self.masking}

    def dense_momentum(self, names: list, averages: list) -> None:
        """Momentum for the layers sent dense, applied to their averaged gradients in place.

        The velocity is updated as u = m*u + avg (pending until ``commit``), and each
        average is overwritten with what plain SGD should apply: u, or avg + m*u with
        Nesterov. One ``torch._foreach`` call per momentum value serves every layer."""
        groups: dict[float, list] = {}
        for name, avg in zip(names, averages):
            m = self._m(name)
            if m:
                groups.setdefault(m, []).append((name, avg))
        for m, items in groups.items():
            avgs = [a for _, a in items]
            pairs = [self.state.pair("velocity", name, a) for name, a in items]
            news = dgc_velocity(avgs, [u for u, _ in pairs], m, out=[new for _, new in pairs])   # u = m*u + avg
            if self.nesterov:
                torch._foreach_add_(avgs, news, alpha=m)                # avg + m*u
            else:
                torch._foreach_copy_(avgs, news)

    def update(self, layer, x: torch.Tensor, message, compressor) -> None:
        """x -= what receivers decode (``ResidualMemory.update``), then the masking: at every position
        sent, or under ``masking="stale"`` at those whose value waited longer than 1/(1-m) steps."""
        positions = message.positions
        if self.masking != "stale" or positions is None or not positions.numel():
            return super().update(layer, x, message, compressor)
        positions = positions.to(torch.int64)
        u = self.state.pending("velocity", layer.name)
        sent_u = u.index_select(0, positions)
        # kept where it did not wait long; a multiply, not a boolean index: no read of the count to the host
        fresh = x.index_select(0, positions).abs() * (1.0 - self._m(layer.name)) <= sent_u.abs()
        compressor.decompress_add(x, message.tensors, layer, alpha=-1.0, ctx=message.ctx)
        u.index_copy_(0, positions, sent_u * fresh)

    def mask(self, name: str, indices: torch.Tensor) -> None:
        """Zero the (pending) velocity at the positions that were sent."""
        if self.masking and indices is not None and indices.numel():
            self.state.pending("velocity", name).index_fill_(0, indices.to(torch.int64), 0.0)
