"""Local steps (``local_steps`` above 1, SBC's communication delay) in the PyTorch optimizer:

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

from ..exchange import NonFiniteGradientError

ROLLED_BACK = (" Under local steps: a worker's step with such a gradient was skipped on that worker, the "
               "round's exchange failed on every rank, and every worker's weights are back at the last "
               "exchange's (the local steps since were dropped).")


def nonfinite_grads(params: dict) -> list:
    """Names of the layers whose gradient holds NaN/Inf, by one host read (as GradScaler does)."""
    named = [(n, p.grad) for n, p in params.items() if p.grad is not None]
    if not named:
        return []
    peaks = torch._foreach_norm([g.detach() for _, g in named], float("inf"))   # NaN propagates, no overflow
    finite = torch.isfinite(torch.stack([p.float() for p in peaks])).tolist()
    return [n for (n, _), ok in zip(named, finite) if not ok]


def local_step(opt, closure, optimizer_step):
    """Step 1, then steps 2-3 when the round ends. ``optimizer_step`` is the wrapped optimizer's own."""
    if opt._snapshot is None:   # after broadcast_parameters, before the first local step
        opt._snapshot = {n: p.detach().clone() for n, p in opt._params.items()}
    ex = opt._exchange
    bad = nonfinite_grads(opt._params) if ex.check_finite and closure is None else []
    opt._nonfinite.update(bad)
    loss = None if bad else optimizer_step(closure)                                    # 1.
    opt._local += 1
    if opt._local % opt._local_steps and not opt._sync_next:
        # dense SGD would have sent this step's gradients: count them for an honest ratio
        ex.stats.add("dense_bytes", 4 * sum(p.numel() for p in opt._params.values()))
        ex.stats.end_step()
        return loss
    decay = getattr(opt.compression_config, "local_decay", 1.0)
    if decay != 1.0:   # SparseLoCo: e = decay * e + delta, before the delta joins
        ex.memory.scale(decay)
    for name in ex.order:                                                               # 2.
        delta = opt._params[name].detach() - opt._snapshot[name]
        if name in opt._nonfinite:
            delta.view(-1)[0] = math.nan
        ex.submit(name, delta)
    try:
        averaged = ex.finish().averages
    except NonFiniteGradientError as error:                                             # 3.
        restart_round(opt, averaged=None)
        raise NonFiniteGradientError(str(error) + ROLLED_BACK) from error
    restart_round(opt, averaged)
    share = getattr(opt, "_share_variance", None)
    if share is not None:   # adam_variance: shared, the next round's denominators (update_units.py)
        ex.stats.add_bytes({"variance": share()}, group="variance")
    return loss


def restart_round(opt, averaged: dict | None) -> None:
    """Every worker from W + the average (or, for a failed round, from W), counting anew."""
    with torch.no_grad():
        for name, p in opt._params.items():
            if averaged is None:
                p.copy_(opt._snapshot[name])
            elif name in averaged:
                p.copy_(opt._snapshot[name] + outer_step(opt, name, averaged[name].view(p.shape)).to(p.dtype))
                opt._snapshot[name].copy_(p)
    opt._local, opt._sync_next = 0, False
    opt._nonfinite.clear()


def outer_step(opt, name: str, delta: torch.Tensor) -> torch.Tensor:
    """How far the common weights move for the average ``delta``: ``delta`` itself, or DiLoCo's outer
    Nesterov step, buf = mu * buf + delta and outer_lr * (delta + mu * buf), with the outer gradient
    taken as -delta (Douillard et al. 2023)."""
    config = opt.compression_config
    mu, lr = getattr(config, "outer_momentum", 0.0), getattr(config, "outer_lr", 1.0)
    if mu:
        buf = opt._outer.get(name)
        buf = opt._outer[name] = delta.clone() if buf is None else buf.mul_(mu).add_(delta)
        delta = delta + mu * buf
    return delta if lr == 1.0 else lr * delta
