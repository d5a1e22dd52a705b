"""RedSync's searches for about the k largest |x| of one segment (Fang et al., JPDC 2019), written
once against the passes of a layer-at-a-time backend (``passes.py``), and DGC's sampled threshold.

=========  ==========================================================  ============
strategy   how                                                          returns
=========  ==========================================================  ============
exact      torch.topk(|x|, k): the reference, slow on big layers        exactly k
trimmed    counts at thr = mean + r*(max-mean), r = 1-eps, 1-2eps, ...; exactly k:
           first r with >= k candidates, exact top-k over those         the top-k,
                                                                        ascending
tbs        binary search on r (at most ``tbs_max_probes`` probes),      k .. 2k
           accept when k <= count <= 2k, else exact top-k over the
           candidates of the last too-low threshold
sampled    DGC: threshold from a strided sample (``sample_fraction``),  k .. 2k
           > 1.3k hits -> exact top-k over them, < k -> thr *= 0.8
=========  ==========================================================  ============

The options are the :class:`~.contract.Contract`'s. With a :class:`SelectionState` and
``threshold_reuse=R > 1`` most calls cost one counting pass: the stored threshold is reused
for up to R-1 steps after a search; a count in [k/2, k) lowers it by 0.8 (one more pass) to
honour the contract; after an exact top-k the state keeps the ~1.5k-th largest |x|, so the
next count lands mid-band. Trimmed starts from its state's threshold whatever R is: its answer is
the exact top-k of any candidate set that holds it (positions ascending, ties at the k-th value to
the lowest), so a step whose count there holds k to 8k costs the compensating pass alone and gives
the bits a search would.

The backend (``registry.py:pick``): native (CPU float32/float64: fused OpenMP passes, a TBS
subtree of probes per count pass; once few enough elements exceed the low end of the
search interval they are gathered and the rest of the search runs on them), cuda (CuPy:
tbs and trimmed take their threshold from two 4096-bin histograms, every probe at once, two
host waits), topk (CUDA below 2**25 elements, where a search costs more in launches and
host waits than torch.topk's radix select: the search is one exact top-k, threshold reuse
still saves it), torch (any device and dtype).
NaN/Inf raise NonFiniteError (a ValueError: "non-finite gradient values in ...") from a
check fused into a pass already made (stats, the index pass, or the top-k values for ``exact``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from .contract import Contract, nonfinite
from .passes import Scan, ScanRequest, cast, sample_plan, sample_threshold
from .reference import kept_mean
from .registry import pick

_SHORTCUT_FRACTION = 16  # TBS: once <= n/16 elements exceed the low threshold, gather them
_COUNT_CHUNK = 7         # trimmed: thresholds per count pass (one register group native)
_TRIM_SLACK = 2          # trimmed: bisect further while more than 2k candidates remain


@dataclass
class SelectionState:
    """Per-layer memory for threshold reuse. Keep one per compressed tensor.

    threshold: last magnitude threshold found (None: search on the next call).
    steps_since_search: calls since that search (0 right after one).
    last_count: elements above the threshold on the last call; searches: searches run.
    """

    threshold: Optional[float] = None
    steps_since_search: int = 0
    last_count: int = 0
    searches: int = 0

    def state_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, d: Dict[str, Any]) -> None:
        self.threshold = None if d.get("threshold") is None else float(d["threshold"])
        self.steps_since_search = int(d.get("steps_since_search", 0))
        self.last_count = int(d.get("last_count", 0))
        self.searches = int(d.get("searches", 0))


def _state_rank(n: int, k: int) -> int:
    """The rank of the threshold a search leaves for reuse: about 1.5k, so that the next reuse
    count lands mid-band."""
    return min(n, k + (k + 1) // 2 + 1)


def _kth_largest(vals: torch.Tensor, kk: int) -> float:
    """The kk-th largest of the finite ``vals``: on the CPU by numpy's introselect, which takes the
    value alone (2.4x faster than torch.topk of kk values and their positions, on 3.2M); the
    same number either way."""
    if vals.device.type != "cpu" or vals.dtype not in (torch.float32, torch.float64):
        return float(torch.topk(vals, kk, sorted=False).values.min())
    a = vals.detach().contiguous().numpy()
    return float(np.partition(a, a.size - kk)[a.size - kk])


def _top(vals: torch.Tensor, k: int, for_state: bool):
    """Positions of the k largest vals, the ~1.5k-th largest value (for a state: the next
    reuse count then lands mid-band; nan otherwise) and the values topk looked at."""
    kk = _state_rank(vals.numel(), k) if for_state else k
    top = torch.topk(vals, kk, sorted=False)  # sorted=True would sort kk values: slow
    pos = top.indices if kk == k else top.indices[torch.topk(top.values, k, sorted=False).indices]
    return pos, (float(top.values.min()) if for_state else math.nan), top.values


def _topk_over(flat: torch.Tensor, cand: torch.Tensor, k: int, vals: Optional[torch.Tensor],
               for_state: bool) -> Tuple[torch.Tensor, float]:
    """Exact top-k among candidate indices (vals: their |x|, gathered if None)."""
    pos, thr, _ = _top(flat[cand].abs() if vals is None else vals, k, for_state)
    return cand[pos], thr


def _exactly_k(flat: torch.Tensor, cand: torch.Tensor, k: int, vals: Optional[torch.Tensor],
               for_state: bool) -> Tuple[torch.Tensor, float]:
    """Trimmed's answer from a candidate set holding the k largest |x|: their positions ascending,
    ties at the k-th value going to the lowest positions. The same tensor whichever set held them, so
    a search and a start from the last threshold give the same bits. Also the ~1.5k-th largest
    value for a state (nan without)."""
    vals = flat[cand].abs() if vals is None else vals
    t = _kth_largest(vals, k)
    over = vals > t
    tied = cand[vals == t].sort().values[:k - int(over.sum())]
    pos = torch.cat([cand[over], tied]).sort().values
    return pos, (_kth_largest(vals, _state_rank(vals.numel(), k)) if for_state else math.nan)


def _exact(flat: torch.Tensor, k: int, err: Optional[ValueError], for_state: bool) -> Tuple[torch.Tensor, float]:
    pos, thr, seen = _top(flat.abs(), k, for_state)
    # torch.topk ranks NaN and Inf above every finite |x|: any present is among `seen`.
    if err is not None and not math.isfinite(float(seen.max())):
        raise err
    return pos, thr


def _bisect(flat, k, be, thr, lo: float, hi: float, c_lo: Optional[int], probes: int, upper: int):
    """The reference TBS walk on r in (lo, hi): accept the first probe with k <= count <= upper.

    Counts for ``be.levels`` consecutive probes come from one pass (all thresholds of that
    subtree); once <= n/16 elements exceed thr(lo), they are gathered and probed alone.
    Returns (indices of |x| > t, t, their |x| or None) for the accepted t; else the
    candidates above thr(lo) (count > upper: the caller takes an exact top-k over them);
    None when no such candidate set is known.
    """
    n = flat.numel()
    cand, sub = None, None  # after the shortcut: elements above thr(lo), a backend on their |x|
    while probes > 0:
        if sub is None and c_lo is not None and c_lo <= max(4 * k, n // _SHORTCUT_FRACTION):
            cand, _, vals = be.select(thr(lo), c_lo, False, True)
            if cand is None:
                break
            sub = be.sub(vals)
        cur = be if sub is None else sub
        levels = min(cur.levels, probes)
        m = 2 ** levels  # the subtree's nodes: lo + (hi-lo)*j/m, walked by integer position
        grid = [lo] + [lo + (hi - lo) * j / m for j in range(1, m)] + [hi]
        counts = [None] + cur.count([thr(r) for r in grid[1:m]])
        a, b = 0, m
        for _ in range(levels):  # the probes the reference would make, one per level
            mid = (a + b) // 2
            c, probes = counts[mid], probes - 1
            if k <= c <= upper:
                t = thr(grid[mid])
                if sub is not None:   # one index pass of the backend's, not a mask and two gathers
                    got, _, vals = sub.select(t, upper, False, True)
                    return cand.index_select(0, got), t, vals
                idx, got, vals = be.select(t, upper, False, True)
                if idx is not None and got >= k:
                    return idx, t, vals
                probes = 0  # count and index pass disagree (cannot on CPU): fall back
                break
            if c < k:
                b = mid
            else:
                a, c_lo = mid, c
        lo, hi = grid[a], grid[b]
    if sub is not None:
        return cand, thr(lo), sub.x
    if c_lo is None:
        return None
    cand, c, vals = be.select(thr(lo), max(n // 4, 4 * k), False, True)
    return (cand, thr(lo), vals) if cand is not None and c >= k else None


def _histogram(flat, k, be):
    """CUDA: every probe of the search at once from two histogram passes (cupy_kernels.py)."""
    search = getattr(be, "histogram_search", None)
    return search(k) if search is not None else None


def _tbs(flat, k, be, o) -> Tuple[torch.Tensor, float]:
    hist = _histogram(flat, k, be)
    if hist is not None:
        cand, t, vals = hist
        return (cand, t) if cand.numel() <= 2 * k else _topk_over(flat, cand, k, vals, be.for_state)
    mx, mean = be.stats()
    thr = lambda r: cast(mean + r * (mx - mean), flat.dtype)  # noqa: E731
    res = _bisect(flat, k, be, thr, 0.0, 1.0, None, o.tbs_max_probes, 2 * k)
    if res is None:
        return _exact(flat, k, be.err, be.for_state)
    cand, t, vals = res
    return (cand, t) if cand.numel() <= 2 * k else _topk_over(flat, cand, k, vals, be.for_state)


def _trimmed(flat, k, be, o) -> Tuple[torch.Tensor, float]:
    hist = _histogram(flat, k, be)
    if hist is not None:
        return _exactly_k(flat, hist[0], k, hist[2], be.for_state)
    above = threshold_set(flat, k, be, o)
    if above is None:
        pos, thr = _exact(flat, k, be.err, be.for_state)
        return pos.sort().values, thr
    return _exactly_k(flat, above[0], k, above[1], be.for_state)


def threshold_set(flat, k, be, o) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Trimmed's candidates: (ascending positions of |x| > t, their |x|) for a t with at least k
    of them, at most 2k where the counts can narrow it; None where no such t was found. Every
    element at or above the k-th largest |x| is among them: the set a top-k is exact over."""
    mx, mean = be.stats()
    thr = lambda r: cast(mean + r * (mx - mean), flat.dtype)  # noqa: E731
    eps = o.trimmed_eps
    ratios = [1.0 - j * eps for j in range(1, int(math.ceil(1.0 / eps)) + 1) if 1.0 - j * eps > 1e-9]
    lo, hi, c_lo = 0.0, 1.0, None
    for i in range(0, len(ratios), _COUNT_CHUNK):
        chunk = ratios[i:i + _COUNT_CHUNK]
        for r, c in zip(chunk, be.count([thr(r) for r in chunk])):
            if c >= k:
                lo, c_lo = r, c
                break
            hi = r
        if c_lo is not None:
            break
    if c_lo is not None and c_lo <= _TRIM_SLACK * k:
        cand, _, vals = be.select(thr(lo), c_lo, False, True)
        return cand, vals
    # Heavy tails: max >> the k-th value, so steps of eps in r jump from < k candidates to
    # a large share of the layer (or to "everything" at r = 0). Bisect (lo, hi) by counting
    # until <= 2k candidates remain: the top-k set, and so the result, is the same.
    res = _bisect(flat, k, be, thr, lo, hi, c_lo, o.tbs_max_probes, _TRIM_SLACK * k)
    return None if res is None else (res[0], res[2])


def _sampled(flat, k, be, o) -> Tuple[torch.Tensor, float]:
    n = flat.numel()
    stride, ks = sample_plan(n, k, o.sample_fraction)
    scan = getattr(be, "scan", None)   # a fused pass took its threshold from the sample of r + g: take it too
    if scan is not None and scan.cap == n and math.isfinite(scan.threshold):
        t = scan.threshold
    else:
        t = sample_threshold(flat[::stride], ks, flat.dtype)
    for attempt in range(o.sample_max_retries + 1):
        cand, c, vals = be.select(t, n, attempt == 0, True)
        if c > 1.3 * k:
            return _topk_over(flat, cand, k, vals, be.for_state)
        if c >= k:
            return cand, t
        if t <= 0.0:
            break
        t = cast(t * 0.8, flat.dtype)
    return _exact(flat, k, be.err, be.for_state)


def _reuse_cap(k: int) -> int:
    return max(8 * k, 1024)


def _reusing(state: Optional[SelectionState], contract: Contract) -> bool:
    """Whether to start from the state's threshold: for up to R-1 steps after a search, and always
    for trimmed, whose answer is the exact top-k of any candidate set that holds it."""
    if state is None or state.threshold is None:
        return False
    return contract.strategy == "trimmed" or state.steps_since_search + 1 < int(contract.threshold_reuse)


def scan_request(state: Optional[SelectionState], k: int, contract: Contract, numel: int = 0) -> Optional[ScanRequest]:
    """What the next search of x (``k``, ``contract``, ``state``) would read first, for the pass
    that computes x to produce it (``native.py:compensate_scan``): the count and hits at the
    reused threshold, or just max/sum|x| before a search, or (sampled, given x's ``numel``) the
    hits above the threshold of DGC's sample, which the pass takes from r + g before it writes
    x. Hand the :class:`Scan` it made to the search as ``scan``. None: nothing to fuse."""
    method = contract.strategy
    if method in ("exact", "radix") or k <= 0:
        return None
    if _reusing(state, contract):
        return ScanRequest(cast(state.threshold, torch.float32), _reuse_cap(k))
    if method == "sampled":
        return ScanRequest(cap=numel, sample=sample_plan(numel, k, contract.sample_fraction)) if k < numel else None
    return ScanRequest()


def _reuse(flat, k, be, state: SelectionState, method: str):
    """One counting pass at the stored threshold. Returns (indices, searched) or None,
    which means 'search now'. A count above 2k but within the pass's cap re-searches
    among the candidates already in hand (no extra pass): the new threshold is the
    ~1.5k-th largest |x|, and tbs/sampled return the ~1.5k elements above it, trimmed the
    exact top-k. With error feedback the residual grows between searches, so counts
    mostly drift upwards."""
    t = cast(state.threshold, flat.dtype)
    cap = _reuse_cap(k)
    idx, c, vals = be.select(t, cap, True, True)
    state.last_count = c
    if c < k / 2 or idx is None:
        return None  # the threshold went stale
    if c > 2 * k:
        if method != "trimmed":  # what a search returns: the elements above the ~1.5k-th largest |x|
            state.threshold = _kth_largest(vals, _state_rank(vals.numel(), k))
            keep = vals > state.threshold
            if int(keep.sum()) >= k:
                return idx[keep], True
        pos, state.threshold = _exactly_k(flat, idx, k, vals, True)   # trimmed
        return pos, True
    tries = 0
    while c < k:  # inside the band but below the contract: loosen, keep reusing
        if tries == 3 or t <= 0.0:
            return None
        t, tries = cast(t * 0.8, flat.dtype), tries + 1
        idx, c, vals = be.select(t, cap, False, True)
        if idx is None:
            return None
    state.threshold = t
    if method == "trimmed":
        return _exactly_k(flat, idx, k, vals, False)[0], False
    if c > 2 * k:
        return _topk_over(flat, idx, k, vals, True)[0], False
    return idx, False


_SEARCH = {"trimmed": _trimmed, "tbs": _tbs, "sampled": _sampled}


def search(x: torch.Tensor, k: int, contract: Contract, *, state: Optional[SelectionState] = None,
           scan: Optional[Scan] = None, name: Optional[str] = None) -> torch.Tensor:
    """Indices (int64, x's device) of about the k largest |x| in ``x.flatten()``, by the contract's
    strategy over the backend the registry picks (one segment of ``select``).

    exact/trimmed return exactly min(k, numel) indices; tbs/sampled between k and 2k.
    k >= numel returns every index; k == 0 or an empty x returns an empty tensor.
    Raises ValueError for k < 0 and NaN/Inf in x (the exact strategy: where ``contract.finite``).
    ``scan``: the first pass, already made over x by whoever computed it (``scan_request``);
    the result is the same, x is read once less.
    """
    k = int(k)
    if k < 0:
        raise ValueError("k must be >= 0, got %d" % k)
    flat = x if x.dim() == 1 and not x.requires_grad else x.detach().reshape(-1)
    n = flat.numel()
    if k == 0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    err = nonfinite(name, x) if contract.finite or contract.strategy != "exact" else None
    if k >= n:
        if err is not None and not bool(torch.isfinite(flat).all()):
            raise err
        return torch.arange(n, dtype=torch.int64, device=x.device)
    if contract.strategy == "exact":
        return _exact(flat, k, err, for_state=False)[0]
    backend, passes = pick(contract.strategy, flat.device, flat.dtype, n, contract.backend, unit="layer")
    be = passes(flat, err, scan)
    be.for_state = state is not None  # only then pay for the reuse threshold
    flat = be.x
    if _reusing(state, contract):
        got = _reuse(flat, k, be, state, contract.strategy)
        if got is not None:
            idx, searched = got
            if searched:
                state.steps_since_search, state.searches = 0, state.searches + 1
                state.last_count = idx.numel()
            else:
                state.steps_since_search += 1
            return idx
    if backend.exact_search:
        idx, thr = _exact(flat, k, err, be.for_state)
        idx = idx.sort().values if contract.strategy == "trimmed" else idx   # trimmed's positions ascend
    else:
        idx, thr = _SEARCH[contract.strategy](flat, k, be, contract)
    if state is not None:
        state.threshold, state.steps_since_search = thr, 0
        state.last_count, state.searches = idx.numel(), state.searches + 1
    return idx


def ranked(x: torch.Tensor, k: int):
    """(values, positions) of the k largest of ``x``, largest first: the exact strategy's order, for
    statistics over the top of a layer (the byte budget's curves, ``policy/allocate.py``)."""
    return torch.topk(x, k)


def exact_signed(x: torch.Tensor, k: int, sign: str, mean: bool) -> tuple:
    """The exact strategy's sign rule (SBC, Sattler et al., 2019): the k largest of the kept
    side (torch.topk of x or -x), "larger" keeping the side whose mean over its k is larger
    (ties: positive). Returns (positions, the signed mean (1,) float32 with ``mean``, else None)."""
    flat = x if x.dim() == 1 and not x.requires_grad else x.detach().reshape(-1)
    pos_vals, pos_idx = torch.topk(flat, k, sorted=False) if sign != "neg" else (None, None)
    neg_vals, neg_idx = torch.topk(-flat, k, sorted=False) if sign != "pos" else (None, None)
    mu_pos = kept_mean(pos_vals) if pos_vals is not None else None
    mu_neg = kept_mean(neg_vals) if neg_vals is not None else None
    if sign == "pos" or (sign == "larger" and bool(mu_pos >= mu_neg)):
        return pos_idx, (mu_pos if mean else None)
    return neg_idx, (-mu_neg if mean else None)
