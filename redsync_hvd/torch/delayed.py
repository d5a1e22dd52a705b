"""Local steps (``local_steps`` above 1, SBC's communication delay), one state object that both
PyTorch adapters drive: :class:`~redsync_hvd.torch.optimizer.DistributedOptimizer` under
horovodrun, and the DDP hook (``ddp.register``), whose hook then sends nothing and which wraps
the optimizer's ``step`` (PyTorch's post-local SGD does the same with a wrapper optimizer):

1. Every step, each worker checks its own gradients (where ``check_finite`` is on) and takes a
   step of its own optimizer; a step whose gradients hold NaN/Inf is skipped on that worker, so
   its weights and moments keep their finite values.
2. Every ``local_steps`` steps (or when ``sync_next_step`` asked), each worker submits its model
   delta W_local - W to the exchange. A worker that skipped a step in this round poisons its
   delta, so the exchange's agreed finiteness check fails the round on every rank alike.
3. A round that passes: W = W + average of the decoded deltas, identical on every rank (or, with
   ``outer_momentum`` / ``outer_lr``, W + DiLoCo's outer Nesterov step on that average); with
   ``adam_variance: shared`` the workers then average their variance estimates for the next round.
   A round that fails: every worker's weights go back to W (the local steps since are dropped)
   and every rank raises, naming the layers; nothing hangs, the residuals stay as they were."""
from __future__ import annotations

import math

import torch

from ..core.wire import finite_evidence
from ..exchange import NonFiniteGradientError

ROLLED_BACK = (" Under local steps: a worker's step with such a gradient was skipped on that worker, the "
               "round's exchange failed on every rank, and every worker's weights are back at the last "
               "exchange's (the local steps since were dropped).")
LOCAL_STEPS_SCALER = ("compression.local_steps: {steps}: a GradScaler skips an overflowing step on the rank that "
                      "overflowed only, which would move that rank's exchanges out of step with the others' (a hang "
                      "at the end of the run): set compression.local_steps: 1 to train with fp16 and a GradScaler "
                      "(the runner does so under training.precision: fp16 where local_steps is auto), or use bf16")

LOCAL_AUTO_NOTE = ("compression.local_steps: {steps} (auto): each worker takes {steps} steps of its own optimizer, "
                   "then sends the top {density:g} of its model delta plus residual (density x {steps}, at least "
                   "0.1; {coding} positions, {values} values){variance}; DGC's momentum correction is off, the "
                   "optimizer's momentum stays on each worker (docs/redsync.md, 'Local steps')")
VARIANCE_NOTE = {"shared_factored": "; Adam's variance shared: averaged at each exchange as each matrix's row and "
                                     "column means (adam_variance: shared_factored)"}
LOCAL_AUTO_OFF_NOTE = "compression.local_steps: 1 (auto): {knobs} need an exchange every step"
EVERY_STEP_NOTE = ("compression.local_steps: 1 (auto): under Adam a run of {steps} steps sends every layer {sends:.0f} "
                   "times at density {density:g} (at least {least}), so the exchange runs every step with error "
                   "feedback in gradient units (Adam steps once on the average), {coding} positions and the layers "
                   "that go dense in fp16 (docs/redsync.md, 'Local steps')")


def local_auto_note(spec, steps: int | None = None) -> str:
    """layers.log's line on what ``local_steps: auto`` settled to, and why (``steps``: the run's
    length, where the caller gave it)."""
    if not spec.delayed and steps and spec.feedback_units == "gradient" and not spec.per_step_knobs():
        from ..config.compression import AUTO_EVERY_STEP_SENDS
        return EVERY_STEP_NOTE.format(steps=steps, sends=spec.density * steps, density=spec.density,
                                      least=AUTO_EVERY_STEP_SENDS,
                                      coding=getattr(getattr(spec, "message", None), "index_coding", "raw"))
    if not spec.delayed:
        why = ", ".join(spec.per_step_knobs()) or "Horovod Elastic's reset broadcasts one model, which"
        return LOCAL_AUTO_OFF_NOTE.format(knobs=why)
    message = getattr(spec, "message", None)
    return LOCAL_AUTO_NOTE.format(steps=spec.local_steps, density=spec.density,
                                  coding=getattr(message, "index_coding", "raw"),
                                  values=getattr(message, "quantize", "fp32"),
                                  variance=VARIANCE_NOTE.get(getattr(spec, "adam_variance", "own"), ""))


def nonfinite_grads(params: dict) -> list:
    """Names of the layers whose gradient holds NaN/Inf, by one host read (as GradScaler does):
    GradScaler's own check, one fused op per device and dtype that flags NaN and Inf (and
    multiplies by 1.0, which leaves every value as it was), as fast as one pass on the CPU, where
    torch's inf-norm ran 8x slower; the layers are named only when a flag is set. A sparse gradient
    (an ``Embedding(sparse=True)`` under local steps) is checked by its values."""
    named = [(n, p.grad.detach()) for n, p in params.items() if p.grad is not None]
    named = [(n, g.coalesce()._values() if g.is_sparse else g) for n, g in named]
    groups: dict = {}
    for _, g in named:
        groups.setdefault((g.device, g.dtype), []).append(g)
    flags = []
    for (device, _), grads in groups.items():
        found, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        flags.append(found)
    if not flags or not bool(torch.cat([f.to(flags[0].device) for f in flags]).any()):
        return []
    return [n for n, g in named if not bool(torch.isfinite(finite_evidence(g)))]


class LocalRounds:
    """Where a worker stands in its round of local steps: the common weights W of the last exchange
    (``snapshot``, taken at the first step, after the adapter made every rank's weights equal), the
    steps taken since, DiLoCo's outer momentum, and whether the next step must end the round.
    ``share_variance``: ``adam_variance: shared``'s exchange of the next round's denominators."""

    def __init__(self, exchange, params: dict, config, share_variance=None):
        self.exchange, self.params, self.config = exchange, params, config
        self.steps, self.share_variance = config.local_steps, share_variance
        self.snapshot, self.local, self.sync_next = None, 0, False
        self.outer: dict = {}       # per parameter, the same on every rank (outer_momentum)
        self.nonfinite: set = set()   # this round's layers whose gradient was not finite
        self.deltas: dict = {}        # per parameter on the CPU, the round's delta (``_delta``)

    def step(self, closure, optimizer_step):
        """Step 1, then steps 2-3 when the round ends. ``optimizer_step``: the worker's own step."""
        if self.snapshot is None:
            self.snapshot = {n: p.detach().clone() for n, p in self.params.items()}
        ex = self.exchange
        bad = nonfinite_grads(self.params) if ex.check_finite and closure is None else []
        self.nonfinite.update(bad)
        loss = None if bad else optimizer_step(closure)                                   # 1.
        self.local += 1
        if self.local % self.steps and not self.sync_next:
            # dense SGD would have sent this step's gradients: count them for an honest ratio
            ex.stats.add("dense_bytes", 4 * sum(p.numel() for p in self.params.values()))
            ex.stats.end_step()
            return loss
        decay = getattr(self.config, "local_decay", 1.0)
        if decay != 1.0:   # SparseLoCo: e = decay * e + delta, before the delta joins
            ex.memory.scale(decay)
        for name in ex.order:                                                              # 2.
            delta = self._delta(name)
            if name in self.nonfinite:
                delta.view(-1)[0] = math.nan
            ex.submit(name, delta)
        try:
            averaged = ex.finish().averages
        except NonFiniteGradientError as error:                                            # 3.
            self.restart(averaged=None)
            raise NonFiniteGradientError(str(error) + ROLLED_BACK) from error
        self.restart(averaged)
        if self.share_variance is not None:   # adam_variance: shared (update_units.py)
            ex.stats.add_bytes({"variance": self.share_variance()}, group="variance")
        return loss

    def _delta(self, name: str) -> torch.Tensor:
        """W_local - W. On the CPU into a buffer kept from round to round: a fresh tensor the
        model's size is mmapped and page-faulted in every round, twice the subtraction's own time
        (the exchange is done with it before the round ends). On a GPU the caching allocator
        reuses the block, and a held one would keep its memory from the local steps' activations."""
        p, w = self.params[name].detach(), self.snapshot[name]
        if p.device.type != "cpu":
            return p - w
        held = self.deltas.get(name)
        if held is None or held.shape != p.shape or held.dtype != p.dtype:
            held = self.deltas[name] = torch.empty_like(p)
        return torch.sub(p, w, out=held)

    def restart(self, averaged: dict | None) -> None:
        """Every worker from W + the average (or, for a failed round, from W), counting anew."""
        with torch.no_grad():
            for name, p in self.params.items():
                if averaged is None:
                    p.copy_(self.snapshot[name])
                elif name in averaged:   # W += step, in place: two passes over the weights fewer than W + step
                    w = self.snapshot[name]
                    w.add_(self.outer_step(name, averaged[name].view(p.shape)).to(p.dtype))
                    p.copy_(w)
        self.local, self.sync_next = 0, False
        self.nonfinite.clear()

    def outer_step(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """How far the common weights move for the average ``delta``: ``delta`` itself, or DiLoCo's
        outer Nesterov step, buf = mu * buf + delta and outer_lr * (delta + mu * buf), with the outer
        gradient taken as -delta (Douillard et al. 2023)."""
        mu, lr = getattr(self.config, "outer_momentum", 0.0), getattr(self.config, "outer_lr", 1.0)
        if mu:
            buf = self.outer.get(name)
            buf = self.outer[name] = delta.clone() if buf is None else buf.mul_(mu).add_(delta)
            delta = delta + mu * buf
        return delta if lr == 1.0 else lr * delta

    def state_dict(self) -> dict:
        return {"local": self.local, "snapshot": self.snapshot, "outer": self.outer}

    def load_state_dict(self, delay: dict) -> None:
        self.local = delay["local"]
        self.snapshot = None if delay["snapshot"] is None else {k: v.clone() for k, v in delay["snapshot"].items()}
        self.outer = {k: v.clone() for k, v in delay.get("outer", {}).items()}
