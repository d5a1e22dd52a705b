"""Compensation, error feedback's first step, in torch ops: the reference every fused form is held to.

    plain       x = r + g
    DGC         u' = m u + g;  x = r + u'   (nesterov: x = r + g + m u')     (Lin et al., ICLR 2018)

DGC's momentum correction keeps, per worker, a velocity u and accumulates it into the residual
instead of the gradient, so momentum applies to what is sent, not to a sparse and delayed
average. :func:`velocity` is its formula and :func:`torch_compensate` the whole step; the fused forms
are backend kernels that also make the selection's first pass while they write x (the native
CPU kernel's ``compensate_scan``, ``core/_native/select_kernels.cpp``; the radix backends'
``compensate``, ``core/select/triton_kernels.py:_pass1``), tested against these functions.

``fma``: u' = g + m u in one rounding where torch fuses the multiply into the add (its ``alpha``
form: the per-layer memories, whose native kernel is compared within an ulp), or m u rounded
first and then added (the order of the radix kernels, compiled without FMA, compared bit for bit).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


def velocity(g: Tensors, u: Tensors, momentum: float, *, out=None, fma: bool = True):
    """DGC's velocity u' = m u + g, into ``out`` where given. Lists of tensors (the dense layers'
    averages) take one ``torch._foreach`` call for all of them."""
    if isinstance(g, (list, tuple)):
        torch._foreach_copy_(out, g)
        torch._foreach_add_(out, u, alpha=momentum)
        return out
    if fma:
        return torch.add(g, u, alpha=momentum, out=out)
    return torch.add(g, u * momentum, out=out)


def corrected(g: torch.Tensor, u_new: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """What DGC adds to the residual (and what SGD applies to a dense layer): u', or with Nesterov
    g + m u'."""
    return g + u_new * momentum if nesterov else u_new


def torch_compensate(residual: torch.Tensor, grad: torch.Tensor, out: Optional[torch.Tensor] = None, *,
               velocity_in: Optional[torch.Tensor] = None, velocity_out: Optional[torch.Tensor] = None,
               momentum: float = 0.0, nesterov: bool = False, fma: bool = True) -> torch.Tensor:
    """1. what this step adds: g (plain), or with ``velocity_in`` DGC's u' (into ``velocity_out``,
    which may be stored in another dtype: u' is computed in fp32 and then stored); 2. out =
    residual + it (a new tensor where ``out`` is None). grad may be fp16/bf16. Returns out."""
    g = grad.float()
    if velocity_in is None:
        return torch.add(residual, g, out=out)
    exact = velocity_out is not None and velocity_out.dtype == torch.float32
    u_new = velocity(g, velocity_in.float(), momentum, out=velocity_out if exact else None, fma=fma)
    if velocity_out is not None and not exact:
        velocity_out.copy_(u_new)
    return torch.add(residual, corrected(g, u_new, momentum, nesterov), out=out)
