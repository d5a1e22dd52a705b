"""What one step of the exchange hands its buckets, what a bucket hands back, and what a step returns.

A step starts with the first gradient (``GradientExchange.submit``) and ends with ``finish()``.
Everything a bucket keeps between the two (its inputs, messages, collective handles, finite
evidence) lives in the bucket itself; the exchange keeps only what the whole step shares
(:class:`StepState`, replaced at every step and by ``abort()``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class StepState:
    """The step's shared figures, taken with its first gradient: its index, a GradScaler's scale
    (a device tensor: gradients arrive multiplied by it), the caller's carry values (summed over
    ranks by the first reduce bucket), the policy's layout key (changes where some layer's k may
    have) and whether the budget observes this step, and which layers are in."""
    step: int = 0
    grad_scale: Optional[torch.Tensor] = None
    carry: Optional[list] = None
    layout: tuple = ()
    observe: bool = False
    submitted: set = field(default_factory=set)
    vetoed: list = field(default_factory=list)   # names the caller failed the step for (``veto``)


@dataclass
class Arrived:
    """What a bucket's ``finish`` returns.

    averages: {name: averaged flat fp32 gradient} of the layers it decoded;
    flags: the bucket's count(s) of non-finite inputs over every rank (a device tensor, > 0 where
        some rank's input was not finite), or None;
    updates: [(layer, wire tensors, alpha)] of layers to apply to the weights once every check has
        passed (``sparse_update``), decoded by the compressor then;
    carried: the sums over ranks of the caller's carry values (the first reduce bucket), or None;
    momentum: names of dense layers whose averages get DGC's momentum after the check."""
    averages: dict = field(default_factory=dict)
    flags: Optional[torch.Tensor] = None
    updates: list = field(default_factory=list)
    carried: Optional[torch.Tensor] = None
    momentum: list = field(default_factory=list)


@dataclass
class StepResult:
    """What ``GradientExchange.finish()`` returns.

    averages: {name: averaged flat fp32 gradient} (valid until the next step: buffers are reused);
    applied: the layers decoded straight into their weights (``sparse_update``), not in averages;
    carried: the sums over ranks of the caller's ``carry`` values, or None."""
    averages: dict
    applied: list = field(default_factory=list)
    carried: Optional[list] = None
