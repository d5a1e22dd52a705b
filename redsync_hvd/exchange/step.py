"""What one step of the exchange accumulates, and the fixed groupings it works in.

A *unit* is what is compressed at once: one layer, or every compressed layer of a bucket when
the compressor selects by bucket (a GPU then waits once per bucket, not per layer). A *bucket*
is what travels at once: an allgather of every layer in it, packed (comm/packing.py). Both
partitions are fixed at start and identical on every rank; the per-step data lives in a
:class:`StepState` that is replaced, not cleared, at every step and by ``abort()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Bucket:
    """Compressed allgather layers that travel as one packed allgather, or (``aggregation``
    sparse_reduce_scatter) as one sparse reduce-scatter (exchange/reduce_scatter.py)."""
    index: int
    layers: tuple
    aggregation: str = "allgather"


@dataclass(frozen=True)
class Unit:
    """Layers compressed at once: one (``together`` False), or a whole bucket
    (``Compressor.selects_by_bucket``: ``compress_bucket`` then sees them all)."""
    layers: tuple
    together: bool = False

    @property
    def key(self) -> str:
        return self.layers[0].name


@dataclass
class StepState:
    submitted: set = field(default_factory=set)
    deferred: dict = field(default_factory=dict)    # name -> grad: blocking compressors, run in finish()
    inputs: dict = field(default_factory=dict)      # unit key -> {name: (grad, scan)} until the unit is complete
    evidence: list = field(default_factory=list)    # (names, device tensor): finite sums or flags, counted in finish()
    bad: list = field(default_factory=list)         # layers this rank knows to be non-finite
    reduce: dict = field(default_factory=dict)      # name -> (handles, message): allreduce in flight
    gather: dict = field(default_factory=dict)      # bucket index -> {name: message}, then the handles
    handles: dict = field(default_factory=dict)     # bucket index -> (header handle, payload handle)
    aggregate: dict = field(default_factory=dict)   # name -> x: residual updated from the average
    momentum_after: list = field(default_factory=list)   # dense layers whose average gets DGC momentum
    kept: dict = field(default_factory=dict)        # name -> x: residual that a reduce-scatter returns entries to
