"""Error feedback in update units under torch's Adam and AdamW: the adapter's two parts.

``memory/adam.py`` keeps each worker's moments and feeds its own Adam direction into the
residual; what arrives for a compressed layer is then the average of the workers' sent Adam
directions, not a gradient. The wrapped optimizer must not run Adam on it again:

    1. ``take_moments``: at build, read (b1, b2), eps and Adam's coupled weight decay per layer
       from the param groups (nothing is taken out: dense layers keep the optimizer's own Adam);
    2. ``UpdateUnitsStep.apply``: before the optimizer's step, every layer the memory sent in update
       units this step moves by w = w*(1 - lr*wd) - lr*average, or lr*sign(average) with the memory's
       ``sign_step`` (DeMo's step, ``method: dct``) (AdamW's decoupled decay; Adam's
       coupled one joined the gradient in the memory), and its ``.grad`` is hidden so the
       optimizer skips it;
    3. ``UpdateUnitsStep.restore``: after the step, the hidden ``.grad`` come back (they are views of
       the exchange's or DDP's bucket buffers).

The Horovod optimizer calls 2 and 3 around its wrapped ``step()``; under the DDP hook they are
the optimizer's step pre- and post-hooks (``torch.optim.Optimizer.register_step_pre_hook``).
"""
from __future__ import annotations

import torch

from ..engine import AdamSpec
from ..memory.adam import average_denominator, average_variance


def take_moments(optimizer, names: dict) -> AdamSpec | str | None:
    """{layer name: hyper-parameters} of a torch.optim.Adam or AdamW; None for any other optimizer;
    why not, for an Adam whose step this does not reproduce (amsgrad, maximize)."""
    if not isinstance(optimizer, torch.optim.Adam):
        return None
    spec = AdamSpec()
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize"):
            return "the optimizer's Adam runs with amsgrad or maximize, whose step this does not reproduce"
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        for p in group["params"]:
            name = names.get(p)
            if name is None:
                continue
            spec.betas[name] = tuple(float(b) for b in group["betas"])
            spec.eps[name] = float(group["eps"])
            if group["weight_decay"] and not decoupled:
                spec.l2[name] = (float(group["weight_decay"]), p)
    return spec


class UpdateUnitsStep:
    """Steps 2 and 3 above for ``optimizer``'s parameters named by ``names`` ({param: name});
    ``memory``: the exchange's :class:`~redsync_hvd.memory.AdamUnitsMemory` (its ``sent``)."""

    def __init__(self, optimizer, names: dict, memory):
        self.optimizer, self.names, self.memory = optimizer, names, memory
        self.hidden: list = []

    def apply(self) -> None:
        sent = self.memory.sent
        if not sent:
            return
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                lr = float(group["lr"])
                decay = group["weight_decay"] if group.get("decoupled_weight_decay",
                                                           isinstance(self.optimizer, torch.optim.AdamW)) else 0.0
                for p in group["params"]:
                    if p.grad is None or self.names.get(p) not in sent:
                        continue
                    if decay:
                        p.mul_(1 - lr * decay)
                    step = p.grad.sign() if self.memory.sign_step else p.grad   # sign_step: DeMo's
                    p.add_(step.to(p.dtype), alpha=-lr)
                    self.hidden.append((p, p.grad))
                    p.grad = None
        self.memory.sent = set()   # applied once: a second step() without an exchange moves nothing

    def restore(self) -> None:
        for p, grad in self.hidden:
            p.grad = grad
        self.hidden = []

    def hook(self, optimizer) -> list:
        """Register steps 2 and 3 as ``optimizer``'s step pre- and post-hooks (the DDP hook's way)."""
        return [optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.apply()),
                optimizer.register_step_post_hook(lambda opt, args, kwargs: self.restore())]


def local_adam(optimizer, names: dict, config, comm) -> tuple:
    """The local steps' own step and what shares the variance, for ``adam_variance`` other than
    ``own``: (Adam's step divided by the average's variance, :func:`of_average_step`; with
    ``shared``, :func:`share_variance` for each exchange). (None, None) with ``own``: the wrapped
    optimizer's own step, and nothing to share."""
    variance = getattr(config, "adam_variance", "own")
    if variance == "own":
        return None, None
    spec = take_moments(optimizer, names)
    if not isinstance(spec, AdamSpec):
        raise ValueError(f"compression.adam_variance: {variance} changes the steps of torch.optim.Adam or AdamW"
                         + (f", and {spec}" if spec else f", not those of {type(optimizer).__name__}")
                         + ": train with a plain Adam or AdamW, or leave adam_variance out")
    share = None
    if variance.startswith("shared"):
        factored = variance == "shared_factored"
        share = lambda: share_variance(optimizer, comm, factored)   # noqa: E731
    return (lambda closure=None: of_average_step(optimizer, comm.size, closure)), share


def of_average_step(optimizer, workers: int, closure=None):
    """One step of a torch Adam or AdamW under local steps with ``adam_variance: of_average``: torch's
    own update and state (``step``, ``exp_avg``, ``exp_avg_sq``, so checkpoints load either way), but
    each parameter divided by the estimate of the N workers' average gradient's second moment
    (``memory/adam.py:average_denominator``) in place of sqrt(v_hat) + eps. With ``adam_variance:
    shared`` a parameter whose state holds ``shared_var`` (:func:`share_variance`) divides by
    sqrt(max(shared_var, own / N)) + eps instead, ``own`` this worker's estimate now: the same number
    on every worker, but where a gradient arrived since the last exchange that the shared variance
    has not seen (a word no batch held before). Frozen alone, the shared variance is about 0
    there and the step m / eps; own / N is what dense Adam's variance would be had only this
    worker's batch held it."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    with torch.no_grad():
        for group in optimizer.param_groups:
            (b1, b2), lr, wd = group["betas"], float(group["lr"]), group["weight_decay"]
            decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = optimizer.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t, g = float(state["step"]), p.grad
                if wd and decoupled:
                    p.mul_(1 - lr * wd)
                elif wd:
                    g = g.add(p, alpha=wd)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if "shared_var" in state:
                    own = average_variance(m, v, 1 - b1 ** t, 1 - b2 ** t, workers).div_(workers)
                    denom = torch.maximum(state["shared_var"], own).sqrt_().add_(group["eps"])
                else:
                    denom = average_denominator(m, v, 1 - b1 ** t, 1 - b2 ** t, workers, group["eps"])
                p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
    return loss


def share_variance(optimizer, comm, factored: bool = False) -> int:
    """``adam_variance: shared``, at each exchange of local steps: every worker's estimate of the
    average gradient's second moment, v_hat / N + (1 - 1/N) * m_hat**2, averaged over the workers
    (one allreduce per parameter, in the param groups' order, the same on every rank) and kept in
    the parameter's state as ``shared_var`` for the next round's steps. With the denominator the
    same everywhere the average of the workers' steps is linear in their momenta: Adam's step of
    the average momentum. A worker's own estimate cannot see what another worker's batch brought
    (a rare word in one batch gets half of dense Adam's step from the average).

    ``factored`` (``shared_factored``): a matrix's estimate E travels as its row and column means
    r, c and comes back as r c^T / mean(E), Adafactor's factored second moment (Shazeer and Stern,
    2018); the means are linear, so the average of the workers' factors is the factor of their
    average. Returns the bytes sent (fp32)."""
    n, sent = comm.size, []
    with torch.no_grad():
        params = [(q, group["betas"]) for group in optimizer.param_groups for q in group["params"]]
        for i, (p, (b1, b2)) in enumerate(params):
            state = optimizer.state[p]
            if state:
                t = float(state["step"])
                est = average_variance(state["exp_avg"], state["exp_avg_sq"], 1 - b1 ** t, 1 - b2 ** t, n)
            else:   # no gradient yet on this rank: it adds nothing, and the collective still matches
                est = torch.zeros_like(p)
            payload = factor(est) if factored and p.dim() > 1 else est
            handle = comm.allreduce_async(payload, name=f"rsync.shared_var.{i}", average=True)
            sent.append((p, state, payload, handle))
        for p, state, _payload, handle in sent:
            got = comm.wait(handle)
            if state:
                state["shared_var"] = unfactor(got, p.shape) if got.shape != p.shape else got
    return 4 * sum(payload.numel() for _, _, payload, _ in sent)


def factor(est: torch.Tensor) -> torch.Tensor:
    """[row means, column means] of ``est`` seen as (its first dimension, the rest)."""
    rows = est.reshape(est.shape[0], -1)
    return torch.cat([rows.mean(1), rows.mean(0)])


def unfactor(means: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """r c^T / mean: the matrix of ``shape`` whose row and column means :func:`factor` sent."""
    r, c = means[:shape[0]], means[shape[0]:]
    return torch.outer(r, c).div_(r.mean().clamp_min(torch.finfo(r.dtype).tiny)).reshape(shape)
