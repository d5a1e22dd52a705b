"""Per-bucket decisions of ``policy.mode: cost_model`` that the run checks against itself.

The cost model prices every bucket twice before the first step (:func:`bucket_prediction`): as the
compressed bucket the exchange built and as the dense allreduce it would otherwise be. A
prediction can be wrong (a shared CPU, Horovod's cycle time, a link that is not what it was
probed as), so the run measures each compressed bucket's own seconds per step and decides again:

    1. before the first step: predicted dense and compressed seconds per bucket (``Review.plan``);
       the dense side is the bucket's allreduce less the part backward hides (``policy.overlap``
       where given; a probed overlap, ``engine/probes.py:probe_overlap``, counts only once step 4
       has a measured compute to bound it: a noisy probe must not send buckets dense unchecked);
    2. for ``policy.review_every`` steps (the first step not counted), each compressed bucket's
       seconds are summed on every rank (its selection and encoding, the wait for its collective,
       its decoding), and each step's compute is taken: its wall time less every bucket's seconds
       (forward, backward, the optimizer, with N processes sharing the host), of which the window
       keeps the median (an evaluation, a checkpoint or another job's turn between two steps
       must not count as compute);
    3. every rank's sums are averaged by one allreduce, and rank 0's verdicts broadcast, so every
       rank flips the same buckets at the same step (a rank alone would hang the collectives);
    4. the dense side is priced again with the measured compute: backward (``BACKWARD`` of it)
       can hide at most its own length of the whole model's dense allreduce;
    5. a compressed bucket whose measured seconds per step exceed its predicted dense seconds by more
       than ``policy.review_margin`` goes dense for the rest of the run (its residual is sent with
       the layer's next gradient); the others stay, with what was measured recorded.

Knobs, and what each trades:

* ``review_every`` (steps): a longer window averages more noise out (a shared host, the first
  steps' allocations) but runs the slow choice longer; 0 turns the review off.
* ``review_margin`` (a fraction): how much slower than the predicted dense time a compressed
  bucket may be measured before it goes dense. The dense side is predicted, not measured, so a
  margin of 0 flips on the model's own error; a large one keeps buckets that cost time.
* A flip is one way: a bucket that went dense is not measured compressed again, and flipping
  back and forth would send its residual in bursts.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from .costmodel import (
    PAIR_HEADER_BYTES,
    ComputeModel,
    LayerCost,
    Network,
    predict_message,
    ring_allgather,
    ring_allreduce,
)

BACKWARD = 2.0 / 3.0   # backward's share of forward + backward (twice forward's work)


@dataclass
class BucketVerdict:
    """One compressed bucket: what was predicted, what was measured, what was decided."""
    index: int
    names: list
    numel: int
    dense_s: float           # predicted: the bucket as one dense fp32 ring allreduce, its exposed part
    compressed_s: float      # predicted: selection + its collective + decoding
    compressed: bool = True
    measured_s: float | None = None   # seconds per step of the last window, averaged over ranks
    steps: tuple | None = None        # (first, last) step of that window
    why: str = "cost model: compressed predicted faster"
    full_s: float | None = None       # predicted: the bucket's dense allreduce, none of it hidden


def bucket_prediction(layers: list, wires: list, collective: str, N: int, net: Network,
                      compute: ComputeModel | None = None, overlap: float = 0.0,
                      fused: bool = False) -> tuple[float, float]:
    """(dense, compressed) predicted seconds per step of one bucket of ``layers`` (numels) whose
    messages are ``wires`` (``Compressor.wire`` per layer) over ``collective``.

    1. dense: one ring allreduce of 4 bytes per element, of which ``1 - overlap`` is exposed
       (``overlap``: the fraction of a dense allreduce that runs hidden behind backward); ``fused``:
       the layers would join a dense bucket that runs anyway, so only their bytes are priced, not
       another collective's latency;
    2. compressed: each layer's selection and decode (``compute``'s measured rates) and its share
       of the collective's bandwidth, plus the collective's latency once for the bucket (and an
       8-byte header per layer for a gather). Selection runs on the step's critical path (on a
       CPU it takes the cores backward uses), so none of it is counted as hidden.
    """
    dense = ring_allreduce(N, 4.0 * sum(layers), net) - (ring_allreduce(N, 0.0, net) if fused else 0.0)
    dense *= 1.0 - overlap
    costs: list[LayerCost] = [predict_message(n, w, collective, N, net, compute=compute, shared=True)
                              for n, w in zip(layers, wires)]
    rounds = ring_allreduce(N, 0.0, net) if collective == "allreduce" else \
        ring_allgather(N, PAIR_HEADER_BYTES * len(layers), net)
    return dense, sum(c.total_s for c in costs) + rounds


@dataclass
class Review:
    """The verdicts of one run's compressed buckets, and when to check them again."""
    every: int
    margin: float
    verdicts: list = field(default_factory=list)
    revision: int = 0    # counts the flips' rounds
    windows: int = 0     # counts the windows decided (each adds measurements to the log)
    history: list = field(default_factory=list)   # [(step, bucket index)] of every flip
    overlap: float = 0.0   # the fraction of a dense allreduce hidden behind backward (probed or given)
    given: bool = False    # overlap is the config's (trusted before any compute was measured)
    compute_s: float | None = None   # measured forward + backward + optimizer per step, last window
    _sums: dict = field(default_factory=dict)
    _since: int = 0
    _step: float = 0.0     # every bucket's seconds so far this step
    _computes: list = field(default_factory=list)   # each step's compute, this window
    _last: float | None = None

    def plan(self, verdict: BucketVerdict) -> None:
        """Step 1: a compressed bucket's predictions."""
        self.verdicts.append(verdict)

    def add(self, index: int, seconds: float) -> None:
        """Step 2: seconds this rank spent on bucket ``index`` this step."""
        self._sums[index] = self._sums.get(index, 0.0) + seconds
        self._step += seconds

    def watched(self) -> list:
        return [v for v in self.verdicts if v.compressed]

    def due(self, steps_done: int, now: float | None = None) -> bool:
        """Whether a window ends with step ``steps_done`` (finished at ``now``, the clock the step
        time is measured on). The first step's seconds are dropped: buffers are allocated and
        thresholds searched from scratch there, once."""
        if now is not None:
            if self._last is not None:
                self._computes.append(max(now - self._last - self._step, 0.0))
            self._last, self._step = now, 0.0
        if steps_done == 1:
            self._sums, self._since, self._computes = {}, 1, []
        return self.every > 0 and bool(self.watched()) and steps_done - self._since >= self.every

    def mine(self) -> list:
        """This rank's sums of the window, one per watched bucket, then its median compute per step
        (what step 3 averages)."""
        return [self._sums.get(v.index, 0.0) for v in self.watched()] + \
            [statistics.median(self._computes) if self._computes else 0.0]

    def hidden(self) -> float:
        """The fraction of each bucket's dense allreduce priced as hidden: ``overlap``, and no more
        of the whole model's than backward lasts (once compute was measured; before, a probed
        overlap counts as none)."""
        total = sum(v.full_s or 0.0 for v in self.verdicts)
        if self.compute_s is None:
            return self.overlap if self.given else 0.0
        if total <= 0:
            return self.overlap
        return min(self.overlap, BACKWARD * self.compute_s / total)

    def decide(self, means: list, steps_done: int, compute: float | None = None) -> list:
        """Steps 4-5, from the window's sums averaged over ranks (``compute``: their median compute
        per step): the verdicts that flip to dense."""
        flips, window = [], steps_done - self._since
        if compute is not None:
            self.compute_s = compute
            for v in self.verdicts:
                if v.full_s is not None:
                    v.dense_s = v.full_s * (1.0 - self.hidden())
        for v, total in zip(self.watched(), means):
            v.measured_s, v.steps = total / max(window, 1), (self._since + 1, steps_done)
            if v.measured_s > v.dense_s * (1.0 + self.margin):
                flips.append(v)
        self._sums, self._since, self._computes = {}, steps_done, []
        self.windows += 1
        return flips

    def flip(self, verdicts: list, steps_done: int) -> None:
        if not verdicts:
            return
        for v in verdicts:
            v.compressed = False
            v.why = (f"review: measured {v.measured_s * 1e3:.3f} ms > predicted dense {v.dense_s * 1e3:.3f} ms "
                     f"x (1 + {self.margin:g})")
            self.history.append((steps_done, v.index))
        self.revision += 1

    def record(self) -> dict:
        return {"every": self.every, "margin": self.margin, "history": [list(h) for h in self.history],
                "overlap": self.overlap, "compute_s": self.compute_s, "hidden": self.hidden(),
                "buckets": [asdict(v) for v in self.verdicts]}


def review_log_lines(record: dict) -> list:
    """layers.log lines, one per bucket the cost model priced: predicted dense and compressed
    seconds, what was decided and why, and what was measured after (once it was)."""
    lines = []
    if record.get("compute_s") is not None:
        lines.append(f"[cost model] compute {record['compute_s'] * 1e3:.3f} ms/step measured (mean over ranks); "
                     f"{record['hidden']:.2f} of a dense allreduce priced hidden (overlap {record['overlap']:.2f}, "
                     f"at most backward's length)")
    for v in record.get("buckets", []):
        names = ", ".join(v["names"][:3]) + (f" +{len(v['names']) - 3}" if len(v["names"]) > 3 else "")
        measured = "not yet measured" if v["measured_s"] is None else \
            f"measured compressed {v['measured_s'] * 1e3:.3f} ms/step over steps {v['steps'][0]}-{v['steps'][1]}"
        lines.append(f"[cost model] bucket {v['index']} ({names}; {v['numel']} elements): "
                     f"{'compressed' if v['compressed'] else 'dense'}; predicted dense {v['dense_s'] * 1e3:.3f} ms, "
                     f"compressed {v['compressed_s'] * 1e3:.3f} ms; {measured}; {v['why']}")
    return lines
