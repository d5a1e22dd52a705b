"""The arithmetic of the per-layer density budget (policy/budget.py runs it).

Uniform density sends the same fraction of every compressed layer, although layers differ in
how much of their compensated gradient x = r + g a message of k elements takes out. Under one
byte budget per step, this chooses each layer's k so that the error the residuals carry on (the
energy of x - decode(message), what error feedback keeps) is least, from statistics measured
every ``budget.every`` steps:

    1. observe (a choosing step only, between compensation and compression): each layer's
       curve of energy taken out at a fixed grid of candidate k (geometric, four per octave,
       within [mean / spread, mean * spread]), from the sorted top of x;
    2. agree: one allreduce averages the curves over the ranks;
    3. choose: ``dp`` (L-GreCo, Markov et al., MLSys 2024: a dynamic program over the curves,
       most energy taken out under the budget) or ``threshold`` (hard threshold, Sahu et al.,
       NeurIPS 2021: one magnitude for every layer, each layer's k what exceeds it); the bytes
       the grid leaves over are then handed out, so the budget is spent to the element;
    4. rank 0's choice is broadcast (every rank uses the same k); it applies from the next step.

With ``objective: descent`` the dp maximises instead what a message of k elements buys the
step's loss to first order, sum(value sent * g) over the sent elements, g the step's gradient
(``descent_curve``): a residual the gradient does not touch buys nothing, however large.

Energy a message of k elements takes out of x:
    values (quantize none/fp16, topk):  the sum of the k largest x**2
    sign_mean (k of one sign, one mean mu = S1/k): S1**2 / k, S1 the sum of the k largest
        magnitudes of that sign; the mean of both signs (the sign alternates per step)
so the dp sees what a single mean costs a layer whose top magnitudes spread widely; the
threshold counts magnitudes only. Exactly k per layer is what makes bytes a budget: the config
refuses selections and codings whose message size varies (config/compression.py).

Bytes per step = what the dense layers send + the per-step finite flag + each compressed
layer's message (per_element * k + fixed) + the statistics, amortised over ``every`` steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..core.layout import k_of
from ..core.select import ranked

GRID_PER_OCTAVE = 4    # candidate densities per factor of two
DP_UNITS = 4000        # the dynamic program's resolution of the budget


@dataclass(frozen=True)
class Cost:
    """Bytes of one compressed layer's message per step: ``per_element * k + fixed``."""
    per_element: int
    fixed: int

    def __call__(self, k) -> int:
        return self.per_element * k + self.fixed


def message_cost(bytes_at: Callable[[int], float]) -> Cost:
    """A layer's message bytes as a line in k, from what its compressor says it sends at k = 1 and
    k = 2 (``bytes_at``: ``Compressor.wire(...).nbytes()``, the bucket's header of counts included)."""
    one, two = bytes_at(1), bytes_at(2)
    return Cost(int(two - one), int(2 * one - two))


def density_of(numel: int, k: int) -> float:
    """The density whose ``k_of`` is exactly k (k / numel, nudged down where rounding would add one)."""
    d = k / numel
    while k_of(numel, d) > k:
        d = math.nextafter(d, 0.0)
    return d


def grid_size(spread: float) -> int:
    """The most candidates a layer has (``candidates``)."""
    return 2 * int(math.ceil(math.log2(spread) * GRID_PER_OCTAVE - 1e-9)) + 3


def bounds(numel: int, mean: float, spread: float) -> tuple:
    """A layer's k stays within [k at mean / spread, k at mean * spread]; at the top, a layer
    too small for that range (k = 1 at the mean) may still send up to ``spread`` elements."""
    return k_of(numel, mean / spread), min(numel, max(k_of(numel, mean * spread), math.ceil(spread)))


def candidates(numel: int, mean: float, spread: float) -> list:
    """Candidate k of a layer: four per octave from the lowest bound to the highest, and the
    uniform density's k, as distinct integers."""
    lo, hi = bounds(numel, mean, spread)
    steps = int(math.ceil(math.log2(hi / lo) * GRID_PER_OCTAVE - 1e-9))
    ks = {min(hi, math.ceil(lo * 2 ** (j / GRID_PER_OCTAVE) - 1e-9)) for j in range(steps + 1)}
    return sorted(ks | {hi, k_of(numel, mean)})


def layer_curve(x: torch.Tensor, ks: list, width: int, sign_mean: bool, length: int | None = None) -> torch.Tensor:
    """[||x||**2, curve(s) at ks]: the sums of the top-k x**2 (values), or of the top-k magnitudes
    of each sign (sign_mean), each padded to ``width`` with its last value, the whole padded with
    zeros to ``length`` (rows of layers in both formats stack)."""
    x = x.detach().reshape(-1).double()
    top = int(ks[-1])
    if sign_mean:
        sums = [ranked(s, top)[0].clamp(min=0).cumsum(0) for s in (x, -x)]
    else:
        sums = [ranked(x.abs(), top)[0].square().cumsum(0)]
    at = torch.tensor(list(ks) + [ks[-1]] * (width - len(ks)), device=x.device) - 1
    row = torch.cat([x.square().sum().reshape(1)] + [s.index_select(0, at) for s in sums]).float()
    return torch.nn.functional.pad(row, (0, (length or row.numel()) - row.numel()))


def descent_curve(x: torch.Tensor, g: torch.Tensor, ks: list, width: int, sign_mean: bool,
                  length: int | None = None) -> torch.Tensor:
    """[||x||**2, curve(s) at ks] as ``layer_curve`` lays them out, the curves being what a message
    of k elements buys this step's loss to first order, sum(value sent * g) over the sent elements:
    the top-k |x| with their values, or (sign_mean) the top-k of each sign, all sent as that
    sign's mean S1/k (``budget.objective: descent``)."""
    x, g = x.detach().reshape(-1).double(), g.detach().reshape(-1).double()
    top = int(ks[-1])
    at = torch.tensor(list(ks) + [ks[-1]] * (width - len(ks)), device=x.device) - 1
    if sign_mean:
        sums = []
        for s in (1.0, -1.0):
            mags, idx = ranked(s * x, top)
            mean = mags.clamp(min=0).cumsum(0) / torch.arange(1, top + 1, device=x.device, dtype=x.dtype)
            sums.append(mean * (s * g[idx]).cumsum(0))
    else:
        idx = ranked(x.abs(), top)[1]
        sums = [(x[idx] * g[idx]).cumsum(0)]
    row = torch.cat([x.square().sum().reshape(1)] + [s.index_select(0, at) for s in sums]).float()
    return torch.nn.functional.pad(row, (0, (length or row.numel()) - row.numel()))


def descent_bought(row: np.ndarray, ks: list, sign_mean: bool) -> np.ndarray:
    """What a message of each candidate k buys (``descent_curve``; sign_mean: the mean of both
    signs, as the sign alternates per step)."""
    n = len(ks)
    if sign_mean:
        width = (len(row) - 1) // 2
        return 0.5 * (row[1:1 + n] + row[1 + width:1 + width + n]).astype(np.float64)
    return row[1:1 + n].astype(np.float64)


def energy_out(row: np.ndarray, ks: list, sign_mean: bool) -> np.ndarray:
    """Energy a message of each candidate k takes out of x (the module docstring's formulas)."""
    n, k = len(ks), np.asarray(ks, dtype=np.float64)
    if sign_mean:
        width = (len(row) - 1) // 2
        return 0.5 * (row[1:1 + n] ** 2 + row[1 + width:1 + width + n] ** 2) / k
    return row[1:1 + n].astype(np.float64)


def carried_curve(row: np.ndarray, ks: list, sign_mean: bool, k_now: int, response: float) -> np.ndarray:
    """Error the residual carries with each candidate k, once error feedback has settled: x was
    measured under ``k_now`` and scales by (k_now / k)**response (what enters a layer each step
    leaves as k elements of about the threshold's size: response 1); the message takes
    ``energy_out`` of the scaled x."""
    scale = (k_now / np.asarray(ks, dtype=np.float64)) ** (2.0 * response)
    return scale * (row[0] - energy_out(row, ks, sign_mean))


def magnitude_curve(row: np.ndarray, ks: list, sign_mean: bool, k_now: int = 1, response: float = 0.0) -> list:
    """Per sign (sign_mean) or for |x|: (k at segment midpoints, magnitude there), from the
    curves' slopes: the mean magnitude of the elements between two candidate k, scaled as
    ``carried_curve`` scales x (a layer given more k settles at a lower threshold)."""
    n, width = len(ks), (len(row) - 1) // 2
    sums = [row[1:1 + n], row[1 + width:1 + width + n]] if sign_mean else [row[1:1 + n]]
    out = []
    for s in sums:
        k = np.concatenate([[0.0], np.asarray(ks, dtype=np.float64)])
        c = np.concatenate([[0.0], np.asarray(s, dtype=np.float64)])
        slope = np.diff(c) / np.maximum(np.diff(k), 1e-300)
        mag = np.sqrt(np.maximum(slope, 0.0)) if not sign_mean else np.maximum(slope, 0.0)
        mid = 0.5 * (k[1:] + k[:-1])
        mag = mag * (k_now / mid) ** response
        out.append((mid, np.maximum.accumulate(mag[::-1])[::-1]))
    return out


def allocate_dp(gains: list, costs: list, capacity: int) -> list:
    """Index of one candidate per layer: the largest total gain (the least error carried, as
    minus ``carried_curve``) with total cost <= capacity (a knapsack over DP_UNITS units of the
    budget, costs rounded up so the result fits)."""
    unit = capacity / DP_UNITS
    best = np.zeros(DP_UNITS + 1)
    choices, weights = [], []
    for gain, cost in zip(gains, costs):
        w = np.ceil(np.asarray(cost, dtype=np.float64) / unit - 1e-9).astype(np.int64)
        new, arg = np.full(DP_UNITS + 1, -np.inf), np.full(DP_UNITS + 1, -1)
        for c, (g, wc) in enumerate(zip(gain, w)):
            if wc > DP_UNITS:
                continue
            cand = np.full(DP_UNITS + 1, -np.inf)
            cand[wc:] = best[:DP_UNITS + 1 - wc] + g
            better = cand > new
            new[better], arg[better] = cand[better], c
        best = new
        choices.append(arg)
        weights.append(w)
    if not np.isfinite(best[DP_UNITS]):
        raise ValueError("policy.budget: the budget is below the smallest candidate of every layer")
    picked, u = [], DP_UNITS
    for arg, w in zip(reversed(choices), reversed(weights)):
        c = int(arg[u])
        picked.append(c)
        u -= int(w[c])
    return picked[::-1]


def allocate_threshold(curves: list, bounds: list, costs: list, capacity: int) -> list:
    """k per layer (floats) for the one magnitude threshold whose counts fill the capacity: a
    layer's k is how many of its magnitudes exceed it (per sign, averaged, for sign_mean)."""
    def ks_at(log_t: float) -> list:
        out = []
        for per_sign, (lo, hi) in zip(curves, bounds):
            counts = [np.interp(-log_t, -np.log(np.maximum(mag, 1e-300)), mid) for mid, mag in per_sign]
            out.append(min(max(float(np.mean(counts)), lo), hi))
        return out
    mags = np.concatenate([mag for per_sign in curves for _, mag in per_sign])
    low, high = math.log(max(mags.min(), 1e-300)) - 1.0, math.log(max(mags.max(), 1e-300)) + 1.0
    for _ in range(100):   # bisection: the largest counts whose bytes fit
        mid = 0.5 * (low + high)
        if sum(c(k) for c, k in zip(costs, ks_at(mid))) > capacity:
            low = mid
        else:
            high = mid
    return ks_at(high)


def fill(ks: list, bounds: list, costs: list, capacity: int) -> list:
    """Integer k within bounds spending the capacity to the element: the spare (or excess)
    bytes shared in proportion to each layer's bytes, then one element at a time, largest
    layers first, while one fits (or until nothing is over)."""
    ks = [int(min(max(math.floor(k), lo), hi)) for k, (lo, hi) in zip(ks, bounds)]
    spare = capacity - sum(c(k) for c, k in zip(costs, ks))
    weight = [c.per_element * k for c, k in zip(costs, ks)]
    if spare and sum(weight):
        ks = [int(min(max(k + math.floor(spare * w / sum(weight) / c.per_element), lo), hi))
              for k, w, c, (lo, hi) in zip(ks, weight, costs, bounds)]
    order = sorted(range(len(ks)), key=lambda i: (-ks[i], i))
    while True:
        spare = capacity - sum(c(k) for c, k in zip(costs, ks))
        moved = False
        for i in order:
            lo, hi = bounds[i]
            if spare < 0 and ks[i] > lo:
                ks[i] -= 1
                spare += costs[i].per_element
                moved = True
            elif 0 < costs[i].per_element <= spare and ks[i] < hi:
                ks[i] += 1
                spare -= costs[i].per_element
                moved = True
        if not moved or (0 <= spare < min(c.per_element for c in costs)):
            return ks
