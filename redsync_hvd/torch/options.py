"""horovod.torch's ``DistributedOptimizer`` keywords, checked once and resolved for the adapter,
and the optimizer a rank outside the ``process_set`` gets.

``op``, ``gradient_predivide_factor``, ``num_groups``/``groups``, ``sparse_as_dense`` and
``process_set`` take what horovod.torch takes; docs/horovod_api.md says what each does here.
Bad values stop with one line naming the value and what to pass instead.
"""
from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..compressors import Compressor
from ..engine import parse

ADASUM = ("op=Adasum combines whole dense gradients by a nonlinear rule (Maleki et al., 2021), which neither "
          "compressed messages nor this exchange's fused buckets (their finite counts inside) can travel through: "
          "use op=hvd.Average or op=hvd.Sum, or horovod.torch.DistributedOptimizer(op=hvd.Adasum) for dense Adasum")


@dataclass(frozen=True)
class HorovodOptions:
    """The resolved keywords: ``op`` "average" | "sum"; ``predivide`` the gradient_predivide_factor;
    ``process_set`` None for every rank (Horovod's global set); ``groups`` an int, a list of
    lists of tensors, or None."""
    op: str = "average"
    predivide: float = 1.0
    sparse_as_dense: bool = False
    process_set: Any = None
    groups: Any = None

    @property
    def default(self) -> bool:
        return self == HorovodOptions()

    @property
    def prescale(self) -> Optional[float]:
        """What each gradient is multiplied by before the exchange (Horovod's prescale_factor)."""
        return 1.0 / self.predivide if self.predivide != 1.0 else None

    def postscale(self, size: int) -> Optional[float]:
        """What the exchange's average is multiplied by: N for a sum, the predivide factor for a
        split average (Horovod's postscale_factor, times N); None when nothing."""
        if self.op == "sum":
            return float(size) if size > 1 else None
        return self.predivide if self.predivide != 1.0 else None


def op_name(op) -> str:
    """"average" | "sum" for hvd.Average / hvd.Sum (or those strings); Adasum and the rest refused."""
    if op is None:
        return "average"
    name = op.lower() if isinstance(op, str) else _horovod_ops().get(op) if isinstance(op, int) else None
    if name == "adasum":
        raise ValueError(ADASUM)
    if name not in ("average", "sum"):
        raise ValueError(f"op={op!r} is not a gradient average or sum: pass op=hvd.Average (the default) or "
                         "op=hvd.Sum")
    return name


def _horovod_ops() -> dict:
    """{horovod.torch's op constant: its name} (empty without Horovod: no constant to match)."""
    try:
        from horovod.torch import mpi_ops  # noqa: WPS433 (the adapter works without Horovod)
    except ImportError:
        return {}
    return {getattr(mpi_ops, n): n.lower() for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product")}


def resolve(op=None, gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
            sparse_as_dense: bool = False, process_set=None) -> HorovodOptions:
    """Check horovod.torch's keywords as horovod.torch does (same conditions, clearer messages)."""
    name = op_name(op)
    factor = float(gradient_predivide_factor)
    if not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r} must be a finite number > 0 "
                         "(1.0, the default, divides by N after the sum only)")
    if factor != 1.0 and name != "average":
        raise ValueError(f"gradient_predivide_factor={factor} splits an average (1/f before the sum, f/N after): "
                         "it needs op=hvd.Average, not op=hvd.Sum")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=3)
        groups = num_groups if groups is None else groups
    _check_groups(groups)
    if process_set is not None and getattr(process_set, "process_set_id", None) is None:
        raise ValueError(f"process_set={process_set} is not registered with Horovod: create it with "
                         "hvd.add_process_set(ranks) (run with HOROVOD_DYNAMIC_PROCESS_SETS=1) or "
                         "hvd.init(process_sets=[...])")
    if process_set is not None and process_set.process_set_id == 0:
        process_set = None   # Horovod's global set: every rank
    return HorovodOptions(name, factor, bool(sparse_as_dense), process_set, groups)


def _check_groups(groups) -> None:
    """horovod.torch's rules: a positive int, or lists of tensors in which no tensor appears twice."""
    if groups is None:
        return
    if not isinstance(groups, list):
        if isinstance(groups, int) and groups > 0:
            return
        raise ValueError(f"groups={groups!r} should be a positive integer (about that many buckets) or a list of "
                         "lists of torch.Tensor")
    seen = set()
    for group in groups:
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"groups must consist of torch.Tensor, got {type(p).__name__} in a group")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups; one appears in two groups")
            seen.add(id(p))


def refuse_for_decentralized(options: HorovodOptions, method: str) -> None:
    """The decentralized methods gossip with neighbours: no average for these keywords to shape."""
    if not options.default:
        raise ValueError(f"compression.method={method!r} trains by gossip between neighbours, without a gradient "
                         "average: op, gradient_predivide_factor, groups, sparse_as_dense and process_set apply to "
                         "the averaging methods only; leave them at their defaults")


def with_group_hint(compression, groups, params: list):
    """``groups=n`` (an int): buckets of at most 1/n of the trainable parameters' fp32 bytes, so
    about n buckets of each kind (compression.fusion_bytes; Horovod's groups fuse that many).
    A list of groups is accepted and changes nothing: buckets are fixed at start by size."""
    if not isinstance(groups, int) or isinstance(groups, bool):
        return compression
    if isinstance(compression, Compressor):
        raise ValueError(f"groups={groups} sets compression.fusion_bytes, which a compressor object fixes: pass "
                         "compression as a dict or config, or leave groups unset")
    config = parse(compression)
    if "fusion_bytes" in config.model_fields_set:
        raise ValueError(f"groups={groups} and compression.fusion_bytes={config.fusion_bytes} both set the bucket "
                         "size: keep one of them")
    total = 4 * sum(p.numel() for p in params)
    return config.model_copy(update={"fusion_bytes": max(-(-total // groups), 1)})


def check_passes(passes) -> None:
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"backward_passes_per_step={passes!r} must be an integer >= 1")


class OutsideProcessSet(torch.optim.Optimizer):
    """A rank outside the ``process_set`` given, as horovod.torch leaves it: the wrapped optimizer
    alone, on this rank's own gradients (no hooks, no exchange, no collective)."""

    def __init__(self, params, backward_passes_per_step):
        super(self.__class__, self).__init__(params)
        check_passes(backward_passes_per_step)
        self.backward_passes_per_step = backward_passes_per_step
        self.exchange = None

    def synchronize(self):
        pass

    @contextmanager
    def skip_synchronize(self):
        yield

    def set_backward_passes_per_step(self, passes: int) -> None:
        check_passes(passes)
        self.backward_passes_per_step = passes

    def set_steps_per_epoch(self, steps: int) -> None:
        pass

    def set_grad_scaler(self, scaler) -> None:
        pass   # the gradients stay local: the scaler checks them itself

    def layer_decisions(self) -> list:
        return []

    def communication_stats(self) -> dict:
        return {}
