"""Top-k selection by magnitude for residual gradient compression (RedSync, Fang et al., JPDC 2019).

    idx = select_topk(v, k, "tbs", state=layer_state, threshold_reuse=5)

Returns int64 indices into ``v.flatten()`` on v's device. Methods and contracts:

=========  ==========================================================  ============
method     how                                                          returns
=========  ==========================================================  ============
exact      torch.topk(|x|, k): the reference, slow on big layers        exactly k
trimmed    counts at thr = mean + r*(max-mean), r = 1-eps, 1-2eps, ...; exactly k:
           first r with >= k candidates, exact top-k over those         the top-k set
tbs        binary search on r (at most ``tbs_max_probes`` probes),      k .. 2k
           accept when k <= count <= 2k, else exact top-k over the
           candidates of the last too-low threshold
sampled    DGC: threshold from a strided sample (``sample_fraction``),  k .. 2k
           > 1.3k hits -> exact top-k over them, < k -> thr *= 0.8
=========  ==========================================================  ============

Options (keyword arguments; any method accepts any of them, irrelevant ones are ignored,
so one config dict can serve every method):
  trimmed_eps=0.2        trimmed: step of r. Heavy tails (max >> k-th value) make a fixed
                         step jump from < k candidates to a large share of the layer, so
                         past 2k candidates the step is bisected by counting (same result).
  tbs_max_probes=20      tbs: probe budget. Each probe halves the r-interval; 20 probes
                         resolve 1e-6 of (max-mean), so the fallback is for ties/odd data.
  sample_fraction=0.01   sampled: fraction sampled (stride floor(1/fraction), >= ~1000 samples).
  sample_max_retries=8   sampled: thr *= 0.8 retries before the exact fallback.
  threshold_reuse=1      R: with a SelectionState, reuse its threshold (one counting pass)
                         for up to R-1 steps after a search; re-search early as soon as the
                         reused count leaves [k/2, 2k]. Counts in [k/2, k) lower the reused
                         threshold by 0.8 (one more pass) to honour the method's contract.
                         After an exact top-k the state keeps the ~1.5k-th largest |x|, so
                         the next count lands mid-band. Ignored by ``exact``.
  backend="auto"         "native" | "cuda" | "torch" | "auto": native when built and x is
                         a CPU float32/float64 tensor, cuda (CuPy kernels) when CuPy is
                         installed and x is a CUDA float32 tensor, torch otherwise.
  name=None              tensor name used in the non-finite error message.

Compute paths (``passes.py``: every search above is written once against them):
  * native (CPU float32/float64, built ahead of time by
    ``python redsync_hvd/core/_native/build.py``): fused OpenMP passes that never
    materialise |x| or a mask: a stats pass (max, sum, finite check); a count pass giving
    ``_NATIVE_LEVELS`` probes of the TBS tree at once (all 7 thresholds of the subtree,
    held in registers); an index pass that also returns |x| of the hits. Once few enough
    elements exceed the low end of the search interval they are gathered and the rest
    of the search runs on them. Gaussian 16M: 3 passes in all, against a radix select.
  * cuda (CUDA float32 with CuPy, ``cuda_select.py``): on a GPU the cost is host waits,
    not passes. tbs and trimmed take their threshold from two 4096-bin histograms of
    the bit patterns of |x| (the second refines the bin holding the k-th value, chosen
    on the device): all probes at once, exact to 128 float ulps, two host waits, then
    the same accept/fallback rules. Threshold reuse and sampled use fused count
    passes of 15 thresholds each.
  * torch (other dtypes, or no native/CuPy): |x| once, then count_nonzero/nonzero
    per probe (2 per sync on CUDA).
NaN/Inf raise NonFiniteError (a ValueError: "non-finite gradient values in ...") from a
check fused into a pass already made (stats, the index pass, or the top-k values for ``exact``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from redsync_hvd.core.passes import (
    NonFiniteError,
    Scan,
    ScanRequest,
    _backend,
    _cast,
    _nonfinite,
    native_available,
    sample_plan,
    sample_threshold,
)

__all__ = ["SelectionState", "select_topk", "scan_request", "METHODS", "native_available", "NonFiniteError"]

METHODS = ("exact", "trimmed", "tbs", "sampled")
_DEFAULTS: Dict[str, Any] = {
    "trimmed_eps": 0.2,
    "tbs_max_probes": 20,
    "sample_fraction": 0.01,
    "sample_max_retries": 8,
    "threshold_reuse": 1,
    "backend": "auto",
    "name": None,
}
_BACKENDS = ("auto", "native", "cuda", "torch")
_SHORTCUT_FRACTION = 16  # TBS: once <= n/16 elements exceed the low threshold, gather them
_COUNT_CHUNK = 7         # trimmed: thresholds per count pass (one register group native)
_TRIM_SLACK = 2          # trimmed: bisect further while more than 2k candidates remain
# CUDA, backend "auto": below this many elements a search costs more in kernel launches
# and host waits (~0.45 ms) than torch.topk's radix select (0.17 ms at 1M, 0.46 ms at 16M
# on an H200), so searches use torch.topk; threshold reuse still saves them.
_CUDA_TOPK_BELOW = 1 << 25


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


def _top(vals: torch.Tensor, k: int, for_state: bool):
    """Positions of the k largest vals, the ~1.5k-th largest value (for a state: the next
    reuse count then lands mid-band; nan otherwise) and the values topk looked at."""
    kk = min(vals.numel(), k + (k + 1) // 2 + 1) if for_state else k
    top = torch.topk(vals, kk, sorted=False)  # sorted=True would sort kk values: slow
    pos = top.indices if kk == k else top.indices[torch.topk(top.values, k, sorted=False).indices]
    return pos, (float(top.values.min()) if for_state else math.nan), top.values


def _topk_over(flat: torch.Tensor, cand: torch.Tensor, k: int, vals: Optional[torch.Tensor],
               for_state: bool) -> Tuple[torch.Tensor, float]:
    """Exact top-k among candidate indices (vals: their |x|, gathered if None)."""
    pos, thr, _ = _top(flat[cand].abs() if vals is None else vals, k, for_state)
    return cand[pos], thr


def _exact(flat: torch.Tensor, k: int, err: ValueError, for_state: bool) -> Tuple[torch.Tensor, float]:
    pos, thr, seen = _top(flat.abs(), k, for_state)
    # torch.topk ranks NaN and Inf above every finite |x|: any present is among `seen`.
    if not math.isfinite(float(seen.max())):
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
                if sub is not None:
                    keep = sub.x > t
                    return cand[keep], t, sub.x[keep]
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
    """CUDA: every probe of the search at once from two histogram passes (cuda_select)."""
    search = getattr(be, "histogram_search", None)
    return search(k) if search is not None else None


def _tbs(flat, k, be, o) -> Tuple[torch.Tensor, float]:
    hist = _histogram(flat, k, be)
    if hist is not None:
        cand, t, vals = hist
        return (cand, t) if cand.numel() <= 2 * k else _topk_over(flat, cand, k, vals, be.for_state)
    mx, mean = be.stats()
    thr = lambda r: _cast(mean + r * (mx - mean), flat.dtype)  # noqa: E731
    res = _bisect(flat, k, be, thr, 0.0, 1.0, None, o["tbs_max_probes"], 2 * k)
    if res is None:
        return _exact(flat, k, be.err, be.for_state)
    cand, t, vals = res
    return (cand, t) if cand.numel() <= 2 * k else _topk_over(flat, cand, k, vals, be.for_state)


def _trimmed(flat, k, be, o) -> Tuple[torch.Tensor, float]:
    hist = _histogram(flat, k, be)
    if hist is not None:
        return _topk_over(flat, hist[0], k, hist[2], be.for_state)
    mx, mean = be.stats()
    thr = lambda r: _cast(mean + r * (mx - mean), flat.dtype)  # noqa: E731
    eps = o["trimmed_eps"]
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
        return _topk_over(flat, cand, k, vals, be.for_state)
    # Heavy tails: max >> the k-th value, so steps of eps in r jump from < k candidates to
    # a large share of the layer (or to "everything" at r = 0). Bisect (lo, hi) by counting
    # until <= 2k candidates remain: the top-k set, and so the result, is the same.
    res = _bisect(flat, k, be, thr, lo, hi, c_lo, o["tbs_max_probes"], _TRIM_SLACK * k)
    return _exact(flat, k, be.err, be.for_state) if res is None else _topk_over(flat, res[0], k, res[2], be.for_state)


def _sampled(flat, k, be, o) -> Tuple[torch.Tensor, float]:
    n = flat.numel()
    stride, ks = sample_plan(n, k, o["sample_fraction"])
    t = sample_threshold(flat[::stride], ks, flat.dtype)   # the one a fused scan took from r + g, bit for bit
    for attempt in range(o["sample_max_retries"] + 1):
        cand, c, vals = be.select(t, n, attempt == 0, True)
        if c > 1.3 * k:
            return _topk_over(flat, cand, k, vals, be.for_state)
        if c >= k:
            return cand, t
        if t <= 0.0:
            break
        t = _cast(t * 0.8, flat.dtype)
    return _exact(flat, k, be.err, be.for_state)


def _reuse_cap(k: int) -> int:
    return max(8 * k, 1024)


def _reusing(state: Optional[SelectionState], reuse: int) -> bool:
    return state is not None and reuse > 1 and state.threshold is not None \
        and state.steps_since_search + 1 < reuse


def scan_request(state: Optional[SelectionState], k: int, method: str = "tbs", *, threshold_reuse: int = 1,
                 numel: int = 0, sample_fraction: float = _DEFAULTS["sample_fraction"]) -> Optional[ScanRequest]:
    """What the next ``select_topk(x, k, method, state=state, threshold_reuse=...)`` would
    read first, for the pass that computes x to produce it (``passes.compensate_scan``):
    the count and hits at the reused threshold, or just max/sum|x| before a search, or
    (sampled, given x's ``numel``) the hits above the threshold of DGC's sample, which the
    pass takes from r + g before it writes x. Pass the returned :class:`Scan` to
    select_topk as ``scan``. None: nothing to fuse."""
    if method == "exact" or k <= 0:
        return None
    if _reusing(state, int(threshold_reuse)):
        return ScanRequest(_cast(state.threshold, torch.float32), _reuse_cap(k))
    if method == "sampled":
        return ScanRequest(cap=numel, sample=sample_plan(numel, k, sample_fraction)) if k < numel else None
    return ScanRequest() if method in ("tbs", "trimmed") else None


def _reuse(flat, k, be, state: SelectionState, method: str):
    """One counting pass at the stored threshold. Returns (indices, searched) or None,
    which means 'search now'. A count above 2k but within the pass's cap re-searches
    among the candidates already in hand (no extra pass): the new threshold is the
    ~1.5k-th largest |x|, and tbs/sampled return the ~1.5k elements above it, trimmed the
    exact top-k. With error feedback the residual grows between searches, so counts
    mostly drift upwards."""
    t = _cast(state.threshold, flat.dtype)
    cap = _reuse_cap(k)
    idx, c, vals = be.select(t, cap, True, True)
    state.last_count = c
    if c < k / 2 or idx is None:
        return None  # the threshold went stale
    if c > 2 * k:
        pos, state.threshold, _ = _top(vals, k, True)   # the ~1.5k-th largest |x| overall
        if method != "trimmed":  # what a search returns: the elements above that threshold
            keep = vals > state.threshold
            if int(keep.sum()) >= k:
                return idx[keep], True
        return idx[pos], True
    tries = 0
    while c < k:  # inside the band but below the contract: loosen, keep reusing
        if tries == 3 or t <= 0.0:
            return None
        t, tries = _cast(t * 0.8, flat.dtype), tries + 1
        idx, c, vals = be.select(t, cap, False, True)
        if idx is None:
            return None
    state.threshold = t
    if method == "trimmed" or c > 2 * k:
        return _topk_over(flat, idx, k, vals, True)[0], False
    return idx, False


_SEARCH = {"trimmed": _trimmed, "tbs": _tbs, "sampled": _sampled}


def _options(method: str, options: Dict[str, Any]) -> Dict[str, Any]:
    if method not in METHODS:
        raise ValueError("unknown selection method %r; valid methods: %s" % (method, ", ".join(METHODS)))
    bad = sorted(set(options) - set(_DEFAULTS))
    if bad:
        raise ValueError("unknown selection option(s) %s; valid options: %s"
                         % (", ".join(bad), ", ".join(sorted(_DEFAULTS))))
    o = dict(_DEFAULTS, **options)
    if not 0.0 < float(o["trimmed_eps"]) <= 1.0:
        raise ValueError("trimmed_eps must be in (0, 1], got %r" % o["trimmed_eps"])
    if int(o["tbs_max_probes"]) < 1:
        raise ValueError("tbs_max_probes must be >= 1, got %r" % o["tbs_max_probes"])
    if not 0.0 < float(o["sample_fraction"]) <= 1.0:
        raise ValueError("sample_fraction must be in (0, 1], got %r" % o["sample_fraction"])
    if int(o["sample_max_retries"]) < 0:
        raise ValueError("sample_max_retries must be >= 0, got %r" % o["sample_max_retries"])
    if int(o["threshold_reuse"]) < 1:
        raise ValueError("threshold_reuse must be an int >= 1, got %r" % o["threshold_reuse"])
    if o["backend"] not in _BACKENDS:
        raise ValueError("unknown backend %r; valid backends: %s" % (o["backend"], ", ".join(_BACKENDS)))
    return o


def select_topk(x: torch.Tensor, k: int, method: str = "tbs", *,
                state: Optional[SelectionState] = None, scan: Optional[Scan] = None,
                **options: Any) -> torch.Tensor:
    """Indices (int64, x's device) of about the k largest |x| in ``x.flatten()``.

    exact/trimmed return exactly min(k, numel) indices; tbs/sampled between k and 2k.
    k >= numel returns every index; k == 0 or an empty x returns an empty tensor.
    Raises ValueError for k < 0, unknown methods/options, and NaN/Inf in x.
    With ``state`` and ``threshold_reuse=R > 1`` most calls cost one counting pass.
    ``scan``: that pass (or a search's statistics pass), already made over x by whoever
    computed it (see ``scan_request``); the result is the same, x is read once less.
    """
    o = _options(method, options)
    k = int(k)
    if k < 0:
        raise ValueError("k must be >= 0, got %d" % k)
    flat = x.detach().reshape(-1)
    n = flat.numel()
    if k == 0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    err = _nonfinite(o["name"], x)
    if k >= n:
        if not bool(torch.isfinite(flat).all()):
            raise err
        return torch.arange(n, dtype=torch.int64, device=x.device)
    if method == "exact":
        return _exact(flat, k, err, for_state=False)[0]
    be = _backend(flat, o["backend"], err, scan)
    be.for_state = state is not None  # only then pay for the reuse threshold
    flat = be.x
    reuse = int(o["threshold_reuse"])
    if _reusing(state, reuse):
        got = _reuse(flat, k, be, state, method)
        if got is not None:
            idx, searched = got
            if searched:
                state.steps_since_search, state.searches = 0, state.searches + 1
                state.last_count = idx.numel()
            else:
                state.steps_since_search += 1
            return idx
    if flat.is_cuda and o["backend"] == "auto" and n < _CUDA_TOPK_BELOW:
        idx, thr = _exact(flat, k, err, be.for_state)   # measured fastest there (docs/benchmarks.md)
    else:
        idx, thr = _SEARCH[method](flat, k, be, o)
    if state is not None:
        state.threshold, state.steps_since_search = thr, 0
        state.last_count, state.searches = idx.numel(), state.searches + 1
    return idx
