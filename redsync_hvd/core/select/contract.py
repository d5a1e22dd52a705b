"""What a selection promises and what it returns: :class:`Contract` in, :class:`Selection` out.

A strategy meets one of two contracts per segment (a layer of a bucket, ``Segments``):

==========  ================================================================  ==========
strategy    how                                                               contract
==========  ================================================================  ==========
exact       torch.topk: the reference                                         exactly k
trimmed     RedSync's trimmed top-k: thresholds stepping down from max|x|     exactly k
tbs         RedSync's threshold binary search (with threshold reuse)          k .. 2k
sampled     DGC's threshold from a strided sample                             k .. 2k
radix       a radix select on the device, every segment at once, no host wait exactly k
==========  ================================================================  ==========

``searches.py`` has the four searches, ``radix.py`` the radix select; the backends that run
them are in ``registry.py``.

The sign rule: ``sign`` None ranks |x|; "pos"/"neg" keep one sign; "larger" keeps, per segment,
the side whose mean magnitude is larger (SBC, Sattler et al., 2019). Exactly-k contracts rank
the kept side (the k largest of that sign); k .. 2k contracts keep that side of what the
threshold selects (``reference.py:keep_side``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

SIGNS = (None, "pos", "neg", "larger")
# the contract each strategy meets: exactly k per segment (True), or k to 2k by a threshold
EXACTLY_K = {"exact": True, "trimmed": True, "tbs": False, "sampled": False, "radix": True}
SEARCHES = ("exact", "trimmed", "tbs", "sampled")


class NonFiniteError(ValueError):
    """x holds NaN or Inf. Every search checks in a pass it makes anyway, so callers that
    select from every gradient need no finite-check pass of their own."""


def nonfinite(name: Optional[str], x: torch.Tensor) -> NonFiniteError:
    """The error a search raises for NaN/Inf in ``x`` (named ``name`` where given)."""
    where = name or "tensor of shape %s" % (tuple(x.shape),)
    return NonFiniteError("non-finite gradient values in %s (NaN or Inf): refusing to select" % where)


def check_sign(sign: Optional[str]) -> None:
    if sign not in SIGNS:
        raise ValueError(f"sign={sign!r} is not one of {SIGNS}")


@dataclass(frozen=True)
class Contract:
    """How to select: the strategy (its contract is ``exactly_k``), the backend ("auto": the
    registry picks per tensor), and the strategies' options (each ignores the others', so one
    config serves every strategy):

    trimmed_eps      trimmed: step of the threshold ratio r. Heavy tails make a fixed step jump
                     from < k candidates to a large share of the layer, so past 2k candidates
                     the step is bisected by counting (same result).
    tbs_max_probes   tbs: probe budget (each probe halves the r-interval).
    sample_fraction  sampled: fraction sampled (stride floor(1/fraction), >= ~1000 samples).
    sample_max_retries  sampled: thr *= 0.8 retries before the exact fallback.
    threshold_reuse  R: with a SelectionState, reuse its threshold (one counting pass) for up to
                     R-1 steps after a search; re-search as soon as the reused count leaves
                     [k/2, 2k]. Ignored by exact and radix; trimmed starts from its state's
                     threshold whatever R is (its exact top-k is the same from any set that holds it).
    finite           exact: raise NonFiniteError for NaN/Inf (the searches always check, radix
                     flags them); False: rank them as torch.topk does (the caller checks).
    """
    strategy: str = "tbs"
    backend: str = "auto"
    trimmed_eps: float = 0.2
    tbs_max_probes: int = 20
    sample_fraction: float = 0.01
    sample_max_retries: int = 8
    threshold_reuse: int = 1
    finite: bool = True

    def __post_init__(self):
        if self.strategy not in EXACTLY_K:
            raise ValueError("unknown selection method %r; valid methods: %s"
                             % (self.strategy, ", ".join(EXACTLY_K)))
        if not 0.0 < float(self.trimmed_eps) <= 1.0:
            raise ValueError("trimmed_eps must be in (0, 1], got %r" % self.trimmed_eps)
        if int(self.tbs_max_probes) < 1:
            raise ValueError("tbs_max_probes must be >= 1, got %r" % self.tbs_max_probes)
        if not 0.0 < float(self.sample_fraction) <= 1.0:
            raise ValueError("sample_fraction must be in (0, 1], got %r" % self.sample_fraction)
        if int(self.sample_max_retries) < 0:
            raise ValueError("sample_max_retries must be >= 0, got %r" % self.sample_max_retries)
        if int(self.threshold_reuse) < 1:
            raise ValueError("threshold_reuse must be an int >= 1, got %r" % self.threshold_reuse)

    @classmethod
    def of(cls, strategy: str, **options) -> "Contract":
        """A contract from keyword options, naming any unknown one."""
        known = {f.name for f in fields(cls)} - {"strategy"}
        bad = sorted(set(options) - known)
        if bad:
            raise ValueError("unknown selection option(s) %s; valid options: %s"
                             % (", ".join(bad), ", ".join(sorted(known))))
        return cls(strategy, **options)

    @property
    def exactly_k(self) -> bool:
        """True: exactly k per segment; False: k to 2k (a threshold's count)."""
        return EXACTLY_K[self.strategy]


@dataclass
class Selection:
    """What every strategy returns, per segment i of the layout (positions layer-local).

    positions: (K,) the segments' positions one segment after another; ``counts[i]`` of them
        for segment i (ascending within a segment, except the exact strategy's torch.topk order).
    counts: per segment, how many were selected (exactly ``seg.ks`` for an exactly-k contract).
    values: (K,) x there in the wire's dtype, where the strategy makes them (radix), else None.
    means: (L,) float32, the kept side's signed mean magnitude, with ``mean``; else None.
    nonfinite: (L,) bool, the segment holds NaN or Inf (where the strategy flags rather than
        raises; its result is still well formed), or None.
    kth: (L,) int32 bits of the k-th largest key of the kept side (radix), or None.
    side: (L,) int8, 0 = positive side kept, 1 = negative (a sign given, radix), or None.
    selected: per segment, what the threshold selected before the sign rule kept a side (the
        histogram backend), or None (then ``counts``).
    """
    positions: torch.Tensor
    counts: tuple
    values: Optional[torch.Tensor] = None
    means: Optional[torch.Tensor] = None
    nonfinite: Optional[torch.Tensor] = None
    kth: Optional[torch.Tensor] = None
    side: Optional[torch.Tensor] = None
    selected: Optional[tuple] = None

    def parts(self, t: Optional[torch.Tensor] = None) -> list:
        """Per segment, its slice of ``positions`` (or of ``t``, laid out alike: the values)."""
        t = self.positions if t is None else t
        out, at = [], 0
        for c in self.counts:
            out.append(t[at:at + c])
            at += c
        return out


@dataclass
class Request:
    """What one call asks besides the contract (``select``'s keyword arguments): the sign rule and
    mean; the first pass made while x was computed (a ``Scan``, or radix's first histogram); the
    searches' per-segment state; the positions' and values' dtypes; with ``update``, x -= what
    receivers decode (error feedback in the same pass) and ``velocity`` zeroed there (DGC)."""
    sign: Optional[str] = None
    mean: bool = False
    first: object = None
    state: object = None
    name: Optional[str] = None
    index_dtype: Optional[torch.dtype] = None
    value_dtype: torch.dtype = torch.float32
    update: bool = False
    velocity: Optional[torch.Tensor] = None
