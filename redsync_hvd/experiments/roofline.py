"""Compensation + selection against the memory-bandwidth limit (``scripts/bench_roofline.py``).

Each selection mode runs the exchange's own steps on one flat fp32 gradient of n elements: the
residual memory's compensation (x = r + g into the spare buffer, with the selection's first pass
where the mode lets it ride along), the selection, the residual update at the sent positions and
the commit. A mode's floor is the bytes per element any implementation of it must move per step:

* every mode reads g and r and writes the new residual: 12 B;
* exact-k (radix) cannot emit before a full pass has fixed its threshold (the k-th value), so x is
  read once more: 16 B;
* TBS with threshold reuse, and trimmed (which starts from its last threshold every step: its
  exact top-k is the same from any set that holds it), emit what passes last step's threshold in
  the compensating pass: 12 B;
* DGC's sampled threshold needs only a strided sample of r + g first (``sample_fraction`` of the
  elements, 8 B each), then one compensating pass that emits: 12 B plus the sample.

The stream limit is a triad ``a = b + s * c`` over fp32 buffers of n elements (12 B per element,
best of several repeats, torch with the same thread count), measured in the same run before
every mode; each share is against the median of them.
"""
from __future__ import annotations

import math
import time

import torch

from redsync_hvd.core.segments import Segments
from redsync_hvd.core.select import Contract, HistogramRequest, SelectionState, compensate, scan_request, select, single
from redsync_hvd.experiments.stats import sync
from redsync_hvd.memory import ResidualMemory

SAMPLE_FRACTION = 0.01   # DGC's (selection.sample_fraction's default)
REUSE = 5                # TBS's threshold_reuse in the RedSync configs
# TBS and sampled send about 1.5k a step (k to 2k): the rate that sets a long run's residual
SENT_PER_K = 1.5


def triad_bytes_per_s(n: int, device, repeats: int = 7) -> float:
    """Best-of-``repeats`` bandwidth of a = b + s * c over n fp32 elements (12 B each)."""
    b, c = (torch.rand(n, device=device) for _ in range(2))
    a = torch.empty_like(b)
    best = math.inf
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 12 * n / best


def steady_residual(n: int, sent: float, device) -> torch.Tensor:
    """The residual of a long run, in units of the gradient's std: each coordinate is a random
    walk of unit Gaussian steps, reset to 0 when its |x| passes the threshold T and it is sent.
    Such a walk's stationary |x| has the density 2 (T - y) / T**2 on [0, T] (the walk's Green's
    function), and a coordinate leaves after about T**2 steps, so T = 1 / sqrt(sent) for the
    share ``sent`` of the elements sent a step. From a zero residual the exchange's own loop
    reaches this law within a few T**2 steps and keeps it (tests/test_roofline.py); a Gaussian
    residual, which no long run has, loses its tail to the first steps' sends instead, so every
    reused threshold goes stale and each step searches anew."""
    T = sent ** -0.5
    gen = torch.Generator().manual_seed(1)
    magnitude = torch.rand(n, generator=gen).sqrt_().neg_().add_(1.0).mul_(T)   # F(y) = 1 - (1 - y/T)**2
    sign = torch.randint(0, 2, (n,), generator=gen).mul_(2).sub_(1)
    return magnitude.mul_(sign).to(device)


class PerLayer:
    """TBS, trimmed or sampled on one layer, as the per-layer path runs them (``memory/residual.py``,
    ``core/select/``: the native kernel on the CPU)."""

    def __init__(self, method: str, n: int, k: int, device, reuse: int = 1, fuse: bool = True):
        self.method, self.n, self.k, self.seg = method, n, k, single(n, k)
        self.contract = Contract(method, threshold_reuse=reuse, sample_fraction=SAMPLE_FRACTION)
        self.memory, self.state = ResidualMemory(fuse=fuse), SelectionState()
        sent = k if method == "trimmed" else SENT_PER_K * k   # trimmed: exactly k
        self.memory.residual["g"] = steady_residual(n, sent / n, device)

    @property
    def floor(self) -> float:
        return 12.0 + (8 * SAMPLE_FRACTION if self.method == "sampled" else 0.0)

    def __call__(self, g: torch.Tensor) -> int:
        c = self.memory.compensate("g", g, scan_request(self.state, self.k, self.contract, self.n))
        idx = select(self.seg, c.x, self.contract, state=self.state, first=c.first).positions
        c.x.index_fill_(0, idx, 0.0)   # what a values message leaves in the residual where it sent
        self.memory.commit()
        return idx.numel()


class ExactK:
    """Exactly k (``selection.method: radix``), as a planned bucket runs it (``exchange/planned.py``):
    ``compensate`` and ``select`` with the residual update, sign-mean messages."""
    floor = 16.0

    def __init__(self, n: int, k: int, device, backend: str):
        self.seg, self.contract = Segments([n], [k], align=16), Contract("radix", backend=backend)
        if self.seg.n != n:   # the gradient must be the bucket's buffer itself, as it is in the exchange
            raise ValueError(f"n={n}: use a multiple of 16 elements (the kernels' alignment)")
        self.r, self.spare = steady_residual(n, k / n, device), torch.zeros(n, device=device)
        self.hints: dict = {}   # the last k-th key, as a planned bucket keeps it

    def __call__(self, g: torch.Tensor) -> int:
        hist = compensate(self.r, g, self.spare, first=HistogramRequest(self.seg, "pos", self.contract))
        sel = select(self.seg, self.spare, self.contract, sign="pos", mean=True, first=hist, update=True,
                     state=self.hints)
        self.r, self.spare = self.spare, self.r
        return sel.positions.numel()


def modes(n: int, k: int, device, backend: str) -> dict:
    """Each mode's step; "unfused": x written by torch.add, then every pass of the selection its
    own (``ResidualMemory(fuse=False)``), what the fused rows save."""
    tbs = "tbs, threshold reuse %d" % REUSE
    return {"exact-k (radix)": lambda: ExactK(n, k, device, backend),
            tbs: lambda: PerLayer("tbs", n, k, device, reuse=REUSE),
            tbs + ", unfused": lambda: PerLayer("tbs", n, k, device, reuse=REUSE, fuse=False),
            "trimmed top-k": lambda: PerLayer("trimmed", n, k, device),
            "sampled (DGC)": lambda: PerLayer("sampled", n, k, device),
            "sampled (DGC), unfused": lambda: PerLayer("sampled", n, k, device, fuse=False)}


def gradient(n: int, step: int, device) -> torch.Tensor:
    """Step ``step``'s gradient: unit Gaussian, independent of every other step's, the same for
    every mode. Drawn anew each step: a few gradients taken in turn would add up to a drift that
    ages the residual within the run (its sum over a cycle comes back every cycle)."""
    gen = torch.Generator(device).manual_seed(step)
    return torch.randn(n, generator=gen, device=device)


def measure(step, n: int, steps: int, warmup: int, device) -> dict:
    """Best, median and mean seconds of ``steps`` steps after ``warmup``, each on its own gradient
    (drawn before the step's clock starts)."""
    times, sent = [], 0
    for i in range(warmup + steps):
        g = gradient(n, i, device)
        sync(device)
        t0 = time.perf_counter()
        sent = step(g)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"best_s": times[0], "median_s": times[len(times) // 2], "mean_s": sum(times) / len(times), "sent": sent}


def row(name: str, n: int, floor: float, got: dict, triad: float) -> dict:
    """Bandwidth at the floor and its share of the triad's, at the best step (the triad's statistic
    too: on a shared machine it is the one least moved by others' work) and at the median step."""
    achieved = floor * n / got["best_s"]
    return {"mode": name, "n": n, "floor_B_per_elem": floor, "best_ms": 1e3 * got["best_s"],
            "ms": 1e3 * got["median_s"], "mean_ms": 1e3 * got["mean_s"], "GB_s": achieved / 1e9,
            "triad_GB_s": triad / 1e9, "share": achieved / triad,
            "share_median": floor * n / got["median_s"] / triad, "sent": got["sent"]}


def run_size(n: int, density: float, device, backend: str, steps: int, warmup: int, only=None,
             exact_steps: int | None = None) -> list:
    """Every mode's row at n elements: the triad first, then the modes on the same gradients.
    ``exact_steps``: exact-k's steps where they differ (the torch reference on a CPU: seconds a step)."""
    k = max(1, math.ceil(density * n))
    got, triads = [], []
    for name, make in modes(n, k, device, backend).items():
        if only and not any(o in name for o in only):
            continue
        triads.append(triad_bytes_per_s(n, device))   # before every mode: the load of a shared machine moves
        step = make()
        timed = (exact_steps, 0) if exact_steps and isinstance(step, ExactK) else (steps, warmup)
        got.append((name, step.floor, measure(step, n, *timed, device)))
        del step
    # the median of the triads (each a best of several): one taken in a lull of a shared machine's load
    # neither sets the limit alone, nor one taken under a burst of it
    triads.sort()
    return [row(name, n, floor, m, triads[len(triads) // 2]) for name, floor, m in got]
