"""Error feedback in the optimizer's units: each worker's own Adam step, not its gradient.

Adam divides each coordinate by its own RMS, so its step is not linear in the gradient. Error
feedback in gradient units (x = r + g, send part of x, Adam on the average) sends a coordinate's
accumulated gradient in one burst after about 1/density steps, and Adam's normalisation turns
that burst into about one step's worth of movement: what waited is lost. Error feedback in the
units of the update (Chen et al., "Quantized Adam with error feedback", 2021) keeps the
moments on each worker, from its own gradient, and feeds the residual with the worker's own
Adam direction:

    1. m = b1*m + (1 - b1)*g;  v = b2*v + (1 - b2)*g**2          (this worker's moments)
    2. s = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps)     (its own Adam direction)
    3. x = r + s;  send part of x;  r = x - what was sent          (the residual in update units)
    4. every worker: w = w*(1 - lr*wd) - lr * mean of what was sent (torch/adam_units.py)

Step 4 is the wrapped optimizer's job for these layers, done by the adapter: the averages are
already Adam directions. Dense layers never pass through a memory, so they keep the wrapped
optimizer's own Adam on their averaged gradient, exactly as dense training.

Adam's coupled weight decay (``Adam(weight_decay=...)``: L2 added to the gradient) joins g
before the moments here, as it would in Adam; AdamW's decoupled decay stays in step 4.

With ``workers`` = N > 1 (``adam_variance: of_average``), step 2 divides by an estimate of the
second moment of the N workers' *average* gradient instead of this worker's own:

    v_avg = v_hat / N + (1 - 1/N) * m_hat**2      (v_hat, m_hat: the bias-corrected moments)

A worker's gradient g = mu + noise has E[g**2] = mu**2 + s**2; the average of N has mu**2 + s**2/N.
v_hat estimates the first and m_hat**2 mu**2 (its noise damped by b1's average), so v_avg estimates
the second. Dense Adam divides by that; each worker's own v is up to N times larger where noise
dominates, which shrinks the averaged step by up to sqrt(N) there (measured: docs/redsync.md).

With ``freeze_after`` = W > 0, v stops at step W (1-bit Adam's frozen variance, Tang et al.
2021) and its bias correction with it: from then on step 2 is linear in m, a fixed scale per
coordinate.

DeMo's two knobs (Peng, Quesnelle and Kingma 2024; ``method: dct``'s ``decay`` and
``sign_step``): with ``decay`` < 1 step 3 is x = decay * r + s, so what waited longer than
about 1 / (1 - decay) steps fades instead of arriving late; with ``sign_step`` step 4 moves
every weight of a sent layer by lr * sign of the average (the adapter reads ``sign_step``).

Moments and residuals are per-worker state: double-buffered (a failed step leaves them as
they were), zeroed where a NaN passed on, saved with the residuals (``exp_avg``,
``exp_avg_sq``, ``steps``) and carried through a resize by ``resize.py``'s rules.
"""
from __future__ import annotations

import torch

from ..core.select import Compensated, ScanRequest, compensate
from .residual import ResidualMemory

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


class AdamUnitsMemory(ResidualMemory):
    """``betas``, ``eps``: {layer name: (b1, b2)}, {layer name: eps}, from the optimizer's param
    groups; ``l2``: {layer name: (weight decay, parameter)} for Adam's coupled weight decay."""
    KINDS = ("residual",) + MOMENT_KEYS
    COUNTERS = ("steps",)

    def __init__(self, betas: dict, eps: dict, l2: dict | None = None, freeze_after: int = 0,
                 decay: float = 1.0, sign_step: bool = False, workers: int = 1):
        super().__init__(fuse=False)   # the native fused pass knows x = r + g and DGC's u only
        self.betas, self.eps, self.l2, self.freeze_after = betas, eps, l2 or {}, freeze_after
        self.workers = workers          # above 1: the variance of the workers' average (docstring)
        self.decay, self.sign_step = decay, sign_step
        self.sent: set = set()          # the layers whose averages are in update units, last step

    @property
    def moments(self) -> dict:
        """{"exp_avg": {name: m}, "exp_avg_sq": {name: v}}: this worker's current moments."""
        return {k: self.state.cur[k] for k in MOMENT_KEYS}

    @property
    def steps(self) -> dict:
        """{name: this worker's Adam steps of the layer} (bias correction)."""
        return self.state.counters["steps"]

    def compensate(self, name: str, grad: torch.Tensor, want: ScanRequest | None = None) -> Compensated:
        """x = r + this worker's own Adam step: the step hook of the one compensation (core/select)."""
        r, x = self.state.pair("residual", name, grad)
        compensate(r, grad, x, step=lambda r, g, out: self._step(name, r, g, out))
        return Compensated(x, None)

    def _step(self, name: str, r: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
        """Steps 1-3 of the module docstring, x = r + s in one addcdiv (torch's Adam rounds so)."""
        g = grad.float()
        if name in self.l2:
            wd, param = self.l2[name]
            g = g.add(param.detach().reshape(g.shape).float(), alpha=wd)
        b1, b2 = self.betas[name]
        t = self.steps.get(name, 0) + 1
        m, m_new = self.state.pair("exp_avg", name, g)
        v, v_new = self.state.pair("exp_avg_sq", name, g)
        torch.lerp(m, g, 1 - b1, out=m_new)                               # 1.
        tv = min(t, self.freeze_after) if self.freeze_after else t         # v's own steps
        if tv < t:
            v_new.copy_(v)
        else:
            torch.mul(v, b2, out=v_new).addcmul_(g, g, value=1 - b2)
        if self.workers > 1:
            denom = average_denominator(m_new, v_new, 1 - b1 ** t, 1 - b2 ** tv, self.workers, self.eps[name])
        else:
            denom = (v_new.sqrt() / (1 - b2 ** tv) ** 0.5).add_(self.eps[name])  # 2. as torch's Adam
        kept = r if self.decay == 1.0 else r * self.decay                  # DeMo's decay
        torch.addcdiv(kept, m_new, denom, value=1 / (1 - b1 ** t), out=x)    # 3. x = r + s

    def flat_terms(self, names: list) -> None:
        return None   # a planned bucket keeps residuals and DGC velocities flat, not moments

    def commit(self) -> None:
        self.sent = self.state.written("residual")
        self.state.count("steps", self.sent)
        super().commit()

    def rollback(self) -> None:
        self.sent = set()
        super().rollback()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.sent = set()


def average_variance(m: torch.Tensor, v: torch.Tensor, bc1: float, bc2: float, workers: int) -> torch.Tensor:
    """v_hat / N + (1 - 1/N) * m_hat**2: the second moment of N workers' average gradient, estimated
    from one worker's bias-corrected moments (module docstring)."""
    return (m / bc1).square_().mul_(1 - 1 / workers).add_(v, alpha=1 / (workers * bc2))


def average_denominator(m: torch.Tensor, v: torch.Tensor, bc1: float, bc2: float, workers: int,
                        eps: float) -> torch.Tensor:
    """sqrt(v_hat / N + (1 - 1/N) * m_hat**2) + eps: Adam's denominator for that second moment."""
    return average_variance(m, v, bc1, bc2, workers).sqrt_().add_(eps)
