"""What one step of the exchange accumulates, the fixed groupings it works in, and what it returns.

A *bucket* is what travels at once, fixed at start and identical on every rank:

* ``gather``: compressed layers whose messages differ per rank (own positions), packed into one
  allgather (comm/packing.py); a bucket the compressor keeps flat (``compresses_flat``: exactly
  k per layer on the device) has a :class:`~redsync_hvd.exchange.plan.BucketPlan`.
* ``reduce``: layers whose messages have the same shape on every rank (dense layers, fp16,
  random-k), concatenated into one flat buffer and summed by one allreduce.

Each bucket also carries its own layers' count of non-finite inputs (and the first reduce bucket
the caller's ``carry`` values), so the step's agreement that every input was finite rides in the
collectives the step makes anyway. A *unit* is what is compressed at once: one layer, or every
compressed layer of a bucket when the compressor selects by bucket. The per-step data lives in a
:class:`StepState` that is replaced, not cleared, at every step and by ``abort()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Bucket:
    """Layers that travel as one collective: ``kind`` "gather" (allgather) or "reduce" (allreduce).
    A gather bucket whose ``aggregation`` is sparse_reduce_scatter meets by exchange/reduce_scatter.py
    instead (an alltoall to the positions' owners, then one allgather of what they keep)."""
    index: int
    layers: tuple
    kind: str = "gather"
    aggregation: str = "allgather"

    @property
    def name(self) -> str:
        return f"rsync.{self.kind}{self.index}"


@dataclass(frozen=True)
class Unit:
    """Layers compressed at once: one (``together`` False), or a whole bucket
    (``Compressor.selects_by_bucket``: ``compress_bucket`` or a plan then sees them all)."""
    layers: tuple
    together: bool = False

    @property
    def key(self) -> str:
        return self.layers[0].name


@dataclass
class StepResult:
    """What ``GradientExchange.finish()`` returns.

    averages: {name: averaged flat fp32 gradient} (valid until the next step: buffers are reused);
    applied: the layers decoded straight into their weights (``sparse_update``), not in averages;
    carried: the sums over ranks of the caller's ``carry`` values, or None."""
    averages: dict
    applied: list = field(default_factory=list)
    carried: Optional[list] = None


@dataclass
class StepState:
    submitted: set = field(default_factory=set)
    deferred: dict = field(default_factory=dict)    # name -> grad: blocking compressors, run in finish()
    inputs: dict = field(default_factory=dict)      # unit key -> {name: grad} until the unit is complete
    trace: list = field(default_factory=list)       # (names, device tensor): all evidence, to name bad layers
    bad: list = field(default_factory=list)         # layers this rank knows to be non-finite
    messages: dict = field(default_factory=dict)    # bucket index -> {name: message} until the bucket is complete
    evidence: dict = field(default_factory=dict)    # bucket index -> [device tensors]: its layers' finite evidence
    handles: dict = field(default_factory=dict)     # bucket index -> what the transport started for it
    aggregate: dict = field(default_factory=dict)   # name -> x: residual updated from the average
    momentum_after: list = field(default_factory=list)   # dense layers whose average gets DGC momentum
    kept: dict = field(default_factory=dict)        # name -> x: the residual a reduce-scatter returns entries to
    carry: Optional[list] = None                    # the caller's carry values, taken once per step
    vetoed: list = field(default_factory=list)      # names the caller failed the step for (``veto``)
