"""What a step does when some rank's inputs were not finite (``GradientExchange.finish``): fail it
(raise, or roll back for a GradScaler), or, with ``check_finite`` off, pass NaN on as an
uncompressed average would."""
from __future__ import annotations

import math

import torch

from .step import StepResult


class NonFiniteGradientError(FloatingPointError):
    pass


def pass_on(ex, out: dict, apply: dict) -> None:
    """check_finite off, and some rank's inputs held NaN/Inf: pass them on as an uncompressed
    average does. Dense fp32 layers hold them already (their sum carries them, element by
    element); a layer that travelled compressed or as fp16 (whose clamp hides an Inf) is NaN
    on every rank where any rank flagged it, agreed by one allreduce of per-layer flags (on
    such steps only). The memories then zero what is not finite, and the compressor's state
    stays as it was (``_settle``)."""
    names = [n for b in ex.buckets if not getattr(b, "passthrough", False) for n in b.names]
    if not names:
        return
    mine = {n for b in ex.buckets for n in b.flagged()}
    flags = torch.tensor([float(n in mine) for n in names], device=ex.layers[names[0]].device)
    agreed = ex.comm.wait(ex.comm.allreduce_async(flags, name="rsync.nonfinite_layers", average=False))
    for name, count in zip(names, agreed.tolist()):
        if count > 0 and name in out:
            out[name].fill_(math.nan)
        elif count > 0 and name in apply:   # sparse_update: the step would write NaN into it
            apply[name][0].fill_(math.nan)


def fail(ex, out: dict, carried) -> StepResult:
    """A step whose inputs (or a vetoed caller's) were not finite on some rank: roll back and
    return inf-filled gradients (``on_nonfinite="skip"``, for a GradScaler), or raise."""
    bad = [n for b in ex.buckets for n in b.flagged()] + ex.state.vetoed
    if ex.on_nonfinite == "skip":
        ex.abort()
        for t in out.values():
            t.fill_(math.inf)
        ex.last = StepResult(out, [], carried)
        return ex.last
    raise NonFiniteGradientError(
        f"non-finite gradient (NaN/Inf) at step {ex.step}"
        + (f" in {bad[:5]} on this rank" if bad else " (on this or another rank)")
        + ". No update was applied and the residuals were left as they were. "
          "Lower the learning rate, clip gradients, or check the input data; "
          "This check is on by default where the method keeps a residual (a NaN there would stay for good); "
          "compression.check_finite=false passes NaN/Inf on instead, as Horovod's uncompressed average does "
          "(residuals stay finite).")
