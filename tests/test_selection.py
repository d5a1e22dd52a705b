"""Tests for redsync_hvd.core.select's searches: trimmed top-k and threshold binary search (Fang et al.,
RedSync, JPDC 2019), DGC's sampled threshold (Lin et al., ICLR 2018)."""
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from redsync_hvd.core.select import (
    METHODS,
    Contract,
    NonFiniteError,
    SelectionState,
    native,
    native_available,
    select,
    select_topk,
)
from redsync_hvd.core.select import paper as reference

BACKENDS = ["torch"] + (["native"] if native_available() else [])
RANGE_METHODS = ("tbs", "sampled")
EXACT_METHODS = ("exact", "trimmed")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def distinct(n, seed=0, dtype=torch.float32):
    """Ties-free magnitudes (a permutation of 1..n, random signs), so top-k is one set."""
    g = torch.Generator().manual_seed(seed)
    mags = (torch.randperm(n, generator=g) + 1).to(dtype) / n
    signs = torch.randint(0, 2, (n,), generator=g).to(dtype) * 2 - 1
    return mags * signs


def sample(dist, n, seed=0):
    torch.manual_seed(seed)
    if dist == "gauss":
        return torch.randn(n)
    if dist == "laplace":
        return torch.distributions.Laplace(0.0, 1.0).sample((n,))
    return torch.distributions.StudentT(3.0).sample((n,))


def true_topk(x, k):
    return set(torch.topk(x.flatten().abs(), k).indices.tolist())


def check_range(x, idx, k):
    """tbs/sampled: k..2k distinct indices, containing the top-k, closed under |x| order."""
    a = x.flatten().abs()
    assert idx.dtype == torch.int64 and idx.device == x.device
    sel = idx.tolist()
    assert len(set(sel)) == len(sel), "duplicate indices"
    assert k <= len(sel) <= 2 * k, (len(sel), k)
    mask = torch.zeros_like(a, dtype=torch.bool)
    mask[idx] = True
    if (~mask).any():
        assert a[mask].min() >= a[~mask].max()  # every selected beats every unselected


# ---- contracts -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", EXACT_METHODS)
@pytest.mark.parametrize(
    "n,k", [(1, 0), (2, 1), (10, 3), (1000, 1), (1000, 10), (4097, 300), (50000, 50), (50000, 5000)]
)
def test_exact_and_trimmed_return_true_topk(method, backend, n, k):
    x = distinct(n, seed=n + k)
    idx = select_topk(x, k, method, backend=backend)
    assert idx.dtype == torch.int64 and idx.numel() == k
    assert set(idx.tolist()) == (true_topk(x, k) if k else set())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", RANGE_METHODS + ("trimmed",))
@pytest.mark.parametrize("dist", ["gauss", "laplace", "t3"])
@pytest.mark.parametrize(
    "n,density", [(20000, 0.001), (20000, 0.01), (20000, 0.1), (1_000_000, 0.001), (1_000_000, 0.01)]
)
def test_distributions(method, backend, dist, n, density):
    x = sample(dist, n, seed=n)
    k = max(1, int(n * density))
    idx = select_topk(x, k, method, backend=backend)
    if method == "trimmed":
        assert idx.numel() == k and set(idx.tolist()) == true_topk(x, k)
    else:
        check_range(x, idx, k)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), frac=st.floats(0.0, 1.2), seed=st.integers(0, 2**16),
       method=st.sampled_from(METHODS), backend=st.sampled_from(BACKENDS))
def test_property_any_size(n, frac, seed, method, backend):
    x = distinct(n, seed=seed).reshape(-1, 1) if n % 2 else distinct(n, seed=seed)
    k = int(n * frac)
    idx = select_topk(x, k, method, backend=backend)
    if k >= n:
        assert idx.tolist() == list(range(n))
    elif k == 0:
        assert idx.numel() == 0
    elif method in EXACT_METHODS:
        assert set(idx.tolist()) == true_topk(x, k) and idx.numel() == k
    else:
        check_range(x, idx, k)


@pytest.mark.parametrize("method", METHODS)
def test_constant_and_sparse_tensors_fall_back(method):
    for x in (torch.ones(5000), torch.zeros(5000), torch.cat([torch.zeros(4990), torch.arange(1.0, 11.0)])):
        idx = select_topk(x, 100, method)
        assert (idx.numel() == 100) if method in EXACT_METHODS else (100 <= idx.numel() <= 200)
        assert torch.equal(torch.sort(x[idx].abs(), descending=True).values[:10],
                           torch.sort(x.abs(), descending=True).values[:10])


@pytest.mark.parametrize("method", METHODS)
def test_layouts_and_dtypes(method):
    base = distinct(6000, seed=3).reshape(60, 100)
    for x in (base.t(), base.double(), base[:, ::2]):  # non-contiguous, float64, strided
        k = 37
        idx = select_topk(x, k, method)
        flat = x.flatten()
        if method in EXACT_METHODS:
            assert set(idx.tolist()) == true_topk(flat, k)
        else:
            check_range(flat, idx, k)
    for dt in (torch.float16, torch.bfloat16):  # torch path; ties possible in 16-bit
        x = torch.randn(5000).to(dt)
        idx = select_topk(x, 50, method)
        lo, hi = (50, 50) if method in EXACT_METHODS else (50, 100)
        assert lo <= idx.numel() <= hi


def reference_tbs(x, k, probes):
    """The paper's walk (core/select/paper.py), probe by probe with plain counts: the positions, or
    None when no probe was accepted."""
    accepted = []

    def count(t):
        c = reference.count_above(x)(t)
        accepted.append(k <= c <= 2 * k)
        return c
    got = set(reference.tbs(x, k, count, max_probes=probes).tolist())
    return got if accepted[-1] else None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dist", ["gauss", "laplace", "t3"])
@pytest.mark.parametrize("k,probes", [(200, 20), (2000, 20), (200, 4), (20000, 2)])
def test_tbs_matches_reference_probe_walk(dist, backend, k, probes):
    x = sample(dist, 200000, seed=k + probes)
    got = set(select_topk(x, k, "tbs", backend=backend, tbs_max_probes=probes).tolist())
    ref = reference_tbs(x, k, probes)
    if ref is None:  # never accepted: exact top-k over the last too-low threshold
        assert len(got) == k and got == true_topk(x, k)
    else:  # same probes, same threshold (the mean may differ in its last bits)
        assert len(got ^ ref) <= max(2, 0.01 * k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dist", ["gauss", "laplace", "t3"])
@pytest.mark.parametrize("k,eps", [(200, 0.2), (2000, 0.1), (20000, 0.3)])
def test_trimmed_matches_the_reference(dist, backend, k, eps):
    """Trimmed top-k returns the exact top-k, as the paper's ratio walk does."""
    x = sample(dist, 200000, seed=k)
    got = set(select_topk(x, k, "trimmed", backend=backend, trimmed_eps=eps).tolist())
    assert got == set(reference.trimmed(x, k, reference.count_above(x), eps=eps).tolist()) == true_topk(x, k)


@pytest.mark.parametrize("levels", [2, 4])
def test_torch_path_batched_probes(monkeypatch, levels):
    """The CUDA setting (several probes per sync) walks the same probes as one per pass."""
    from redsync_hvd.core.select.passes import TorchPasses

    init = TorchPasses.__init__

    def batched(self, flat, err, scan=None):
        init(self, flat, err, scan)
        self.levels = levels

    monkeypatch.setattr(TorchPasses, "__init__", batched)
    for dist, k, probes in (("gauss", 200, 20), ("t3", 2000, 20), ("laplace", 200, 5)):
        x = sample(dist, 100000, seed=k)
        got = set(select_topk(x, k, "tbs", backend="torch", tbs_max_probes=probes).tolist())
        ref = reference_tbs(x, k, probes)
        assert got == ref if ref is not None else got == true_topk(x, k)
        assert set(select_topk(x, k, "trimmed", backend="torch").tolist()) == true_topk(x, k)


def test_tbs_probe_budget_falls_back():
    x = sample("t3", 100000)
    idx = select_topk(x, 100, "tbs", tbs_max_probes=1)  # one probe cannot reach the tail
    check_range(x, idx, 100)


# ---- edge cases and errors --------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_edge_cases(method):
    x = torch.randn(7, 3)
    assert select_topk(x, 0, method).numel() == 0 and select_topk(x, 0, method).dtype == torch.int64
    assert select_topk(x, 21, method).tolist() == list(range(21))
    assert select_topk(x, 500, method).tolist() == list(range(21))
    e = select_topk(torch.empty(0), 5, method)
    assert e.numel() == 0 and e.dtype == torch.int64
    with pytest.raises(ValueError, match="k must be >= 0"):
        select_topk(x, -1, method)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(method, backend, bad):
    for n, k in ((100, 5), (200000, 200), (10, 10)):
        x = torch.randn(n)
        x[n // 3] = bad
        with pytest.raises(ValueError, match="non-finite gradient values in layer.w"):
            select_topk(x, k, method, backend=backend, name="layer.w")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", METHODS)
def test_huge_finite_values_are_not_non_finite(method, backend):
    x = distinct(20000, seed=9) * 3e38  # float32 partial sums of |x| overflow: not an error
    idx = select_topk(x, 20, method, backend=backend)
    assert (idx.numel() == 20) if method in EXACT_METHODS else (20 <= idx.numel() <= 40)
    assert true_topk(x, 20) <= set(idx.tolist())


def test_non_finite_on_reuse_step():
    x = torch.randn(10000)
    st_ = SelectionState()
    select_topk(x, 10, "tbs", state=st_, threshold_reuse=10)
    x[5] = float("nan")
    with pytest.raises(ValueError, match="non-finite gradient values in"):
        select_topk(x, 10, "tbs", state=st_, threshold_reuse=10)


def test_bad_arguments():
    x = torch.randn(100)
    with pytest.raises(ValueError, match=r"unknown selection method 'topk'.*exact, trimmed, tbs, sampled"):
        select_topk(x, 5, "topk")
    with pytest.raises(ValueError, match=r"unknown selection option\(s\) tbs_probes.*tbs_max_probes"):
        select_topk(x, 5, "tbs", tbs_probes=3)
    with pytest.raises(ValueError, match="backend='gpu' is not one of"):
        select_topk(x, 5, backend="gpu")
    for opt in ({"trimmed_eps": 0.0}, {"tbs_max_probes": 0}, {"sample_fraction": 2.0},
                {"threshold_reuse": 0}, {"sample_max_retries": -1}):
        with pytest.raises(ValueError, match=list(opt)[0]):
            select_topk(x, 5, "tbs", **opt)
    with pytest.raises(ValueError, match="backend='native' unavailable"):
        select_topk(x.half(), 5, "tbs", backend="native")


# ---- threshold reuse ---------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ("tbs", "sampled"))
def test_reuse_counts_only_then_researches_every_R(method, backend):
    x, k, R = sample("gauss", 100000, seed=1), 100, 4
    s = SelectionState()
    searches = []
    for step in range(9):
        xi = x * (1 + 0.002 * step)  # slow drift: the threshold stays good
        idx = select_topk(xi, k, method, state=s, threshold_reuse=R, backend=backend)
        searches.append(s.searches)
        check_range(xi, idx, k)
    assert searches == [1, 1, 1, 1, 2, 2, 2, 2, 3]  # search, R-1 reuse steps, search, ...
    assert s.steps_since_search == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reuse", (1, 4))
def test_trimmed_starts_from_its_last_threshold_and_gives_a_searchs_bits(reuse, backend):
    """Trimmed's exact top-k is the same from any candidate set that holds it, so with a state it
    tries the last threshold every step, whatever threshold_reuse says, and searches only when the
    count there leaves the band: each step's positions are a stateless search's, tensor for tensor
    (ascending, ties at the k-th value to the lowest position; the data is rounded to make ties)."""
    x, k = torch.round(sample("laplace", 100000, seed=1) * 8) / 8, 100   # 97 above the k-th value, 14 at it
    s = SelectionState()
    for step in range(9):
        xi = x * (1 + 0.002 * step)  # slow drift: the threshold stays good
        idx = select_topk(xi, k, "trimmed", state=s, threshold_reuse=reuse, backend=backend)
        assert torch.equal(idx, select_topk(xi, k, "trimmed", backend=backend))
        a = xi.abs()
        t = torch.topk(a, k).values.min()
        over, tied = (a > t).nonzero().flatten(), (a == t).nonzero().flatten()
        assert torch.equal(idx, torch.cat([over, tied[:k - over.numel()]]).sort().values)
    assert s.searches == 1 and s.steps_since_search == 8


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ("trimmed", "tbs", "sampled"))
def test_reuse_researches_when_count_leaves_band(method, backend):
    x, k = sample("laplace", 50000, seed=2), 50
    for scale in (10.0, 0.1):  # count explodes (> 2k) / vanishes (< k/2)
        s = SelectionState()
        select_topk(x, k, method, state=s, threshold_reuse=100, backend=backend)
        assert s.searches == 1
        y = x * scale
        idx = select_topk(y, k, method, state=s, threshold_reuse=100, backend=backend)
        assert s.searches == 2 and s.steps_since_search == 0
        assert (idx.numel() == k) if method == "trimmed" else (k <= idx.numel() <= 2 * k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ("trimmed", "tbs", "sampled"))
def test_reuse_above_the_band_takes_the_rank_1_5k_value_of_what_it_counted(method, backend):
    # the count at the old threshold is past 2k: the new threshold is the ~1.5k-th largest |x| among
    # the elements counted (torch.topk's, ties included), and tbs/sampled send the elements above it
    x, k = torch.round(sample("laplace", 50000, seed=5) * 64) / 64, 50   # rounded: ties at every rank
    s = SelectionState()
    select_topk(x, k, method, state=s, threshold_reuse=100, backend=backend)
    y = x * 1.5
    counted = y.abs()[y.abs() > s.threshold]
    idx = select_topk(y, k, method, state=s, threshold_reuse=100, backend=backend)
    assert 2 * k < counted.numel() <= max(8 * k, 1024) and s.searches == 2   # within the pass's cap: no new pass
    assert s.threshold == float(torch.topk(counted, k + (k + 1) // 2 + 1).values.min())
    if method == "trimmed":
        assert idx.numel() == k
    else:
        assert torch.equal(torch.sort(idx).values, (y.abs() > s.threshold).nonzero().flatten())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ("trimmed", "tbs", "sampled"))
def test_reuse_low_count_inside_band_loosens_without_search(method, backend):
    x, k = sample("gauss", 50000, seed=4), 100  # a tail where thr * 0.8 is a moderate step
    s = SelectionState()
    select_topk(x, k, method, state=s, threshold_reuse=100, backend=backend)
    t = s.threshold
    above = (x.abs() > t).nonzero().flatten()
    y = x.clone()
    y[above[: above.numel() - int(0.7 * k)]] *= 0.01  # leave 0.7k above t: inside [k/2, 2k)
    assert k / 2 <= int((y.abs() > t).sum()) < k
    idx = select_topk(y, k, method, state=s, threshold_reuse=100, backend=backend)
    assert s.searches == 1 and s.steps_since_search == 1  # no search: loosened by 0.8
    assert s.threshold < t
    if method == "trimmed":
        assert set(idx.tolist()) == true_topk(y, k)
    else:
        check_range(y, idx, k)


def test_exact_ignores_reuse_and_state_round_trip():
    x = torch.randn(3000)
    s = SelectionState()
    assert select_topk(x, 30, "exact", state=s, threshold_reuse=5).numel() == 30
    assert s.threshold is None
    select_topk(x, 30, "tbs", state=s, threshold_reuse=5)
    select_topk(x, 30, "tbs", state=s, threshold_reuse=5)
    d = s.state_dict()
    assert d == {"threshold": s.threshold, "steps_since_search": 1, "last_count": s.last_count, "searches": 1}
    s2 = SelectionState()
    s2.load_state_dict(d)
    assert s2 == s
    a = select_topk(x, 30, "tbs", state=s, threshold_reuse=5)
    b = select_topk(x, 30, "tbs", state=s2, threshold_reuse=5)
    assert torch.equal(a, b) and s == s2
    s3 = SelectionState()
    s3.load_state_dict({})  # defaults: next call searches
    assert s3.threshold is None and s3.steps_since_search == 0


# ---- native path ------------------------------------------------------------------------

needs_native = pytest.mark.skipif(not native_available(), reason="native kernel not built")


@needs_native
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dist", ["gauss", "t3"])
def test_native_and_torch_agree(method, dist):
    for n, k in ((3000, 3), (100000, 100), (100000, 5000)):
        x = sample(dist, n, seed=k)
        a = set(select_topk(x, k, method, backend="native").tolist())
        b = set(select_topk(x, k, method, backend="torch").tolist())
        # Same probes, same thresholds up to the last bit of the mean: equal in practice.
        assert len(a ^ b) <= max(2, 0.01 * k), (len(a), len(b))


@needs_native
def test_native_kernels_directly():
    m = native.load()
    x = torch.randn(300001)
    mx, s = m.stats(x)
    assert mx == float(x.abs().max()) and math.isclose(s, float(x.double().abs().sum()), rel_tol=1e-5)
    thr = torch.tensor([0.0, 0.5, 2.0, 9.0])
    assert m.count_multi(x, thr).tolist() == [int((x.abs() > t).sum()) for t in thr]
    idx, vals, c, finite = m.select_above(x, 2.0, 10**9, True, True)
    assert finite and c == idx.numel() and torch.equal(idx, (x.abs() > 2.0).nonzero().flatten())
    assert torch.equal(vals, x.abs()[idx])
    idx, vals, c, _ = m.select_above(x, 2.0, 10, False)  # over the cap: count only
    assert idx.numel() == 0 and vals.numel() == 0 and c > 10
    ref = (x.abs() > 0.3).nonzero().flatten()  # dense hits: the cap lands inside groups
    for cap in (ref.numel(), ref.numel() - 1, 37):
        idx, vals, c, _ = m.select_above(x, 0.3, cap, False, True)
        assert c == ref.numel()
        assert torch.equal(idx, ref) if cap >= c else idx.numel() == 0
    x[123] = float("inf")
    assert not m.select_above(x, 2.0, 10**9, True)[3]
    x[123] = float("nan")
    assert not m.select_above(x, 2.0, 10**9, True)[3]
    for dt in (torch.float64,):
        y = x.to(dt)
        y[123] = 0.5
        assert m.count_multi(y, thr.to(dt)).tolist() == [int((y.abs() > t).sum()) for t in thr.to(dt)]
        assert torch.equal(m.select_above(y, 1.5, 10**9, True)[0], (y.abs() > 1.5).nonzero().flatten())


@needs_native
@pytest.mark.parametrize("side", [0, 1, -1])
@pytest.mark.parametrize("density", [0.001, 0.1, 0.6])
def test_native_select_above_at_any_density_equals_the_torch_selection(side, density):
    """Dense messages (local steps send about 10%) take the vector compaction, a capped chunk the
    scalar one: both give every key above the threshold, in ascending order, with its key."""
    m = native.load()
    x = torch.randn(3 * 65536 + 77, generator=torch.Generator().manual_seed(3))
    x[5], x[6], x[70000] = 0.0, -0.0, 0.0
    key = x.abs() if side == 0 else (side * x).clamp(min=0.0)
    thr = float(key.quantile(1 - density)) if density < 0.5 else 0.0
    ref = (key > thr).nonzero().flatten()
    for cap in (x.numel(), 65536, ref.numel(), 1000):   # the last two cap inside a chunk
        idx, vals, c, finite = m.select_above(x, thr, cap, True, True, side)
        assert finite and c == ref.numel()
        if cap < c:
            assert idx.numel() == 0 and vals.numel() == 0
            continue
        assert torch.equal(idx, ref) and torch.equal(vals, key[ref])
    x[x.numel() - 40] = float("nan")   # in a group the vector path reads whole
    assert not m.select_above(x, thr, x.numel(), True, False, side)[3]


def test_loader_can_be_disabled(monkeypatch):
    monkeypatch.setenv("REDSYNC_NO_NATIVE", "1")
    assert native.load(force=True) is None and "REDSYNC_NO_NATIVE" in native.load.error
    assert select_topk(torch.randn(1000), 10, "tbs").numel() >= 10  # torch path
    monkeypatch.delenv("REDSYNC_NO_NATIVE")
    if native_available():  # a module built for another torch is never loaded
        monkeypatch.setattr(torch, "__version__", "0.0.1+other")
        assert native.load(force=True) is None and "another torch" in native.load.error
        monkeypatch.undo()
    native.load(force=True)


# ---- CUDA -----------------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dist", ["gauss", "t3"])
def test_cuda(method, dist):
    x = sample(dist, 1_000_000).cuda()
    k = 1000
    idx = select_topk(x, k, method)
    assert idx.is_cuda and idx.dtype == torch.int64
    if method in EXACT_METHODS:
        assert set(idx.cpu().tolist()) == true_topk(x.cpu(), k)
    else:
        check_range(x, idx, k)
    x[7] = float("nan")
    with pytest.raises(ValueError, match="non-finite gradient values in"):
        select_topk(x, k, method)


@cuda
def test_cuda_reuse():
    x = sample("gauss", 200000).cuda()
    s = SelectionState()
    for _ in range(4):  # search, reuse, reuse, search
        check_range(x, select_topk(x, 200, "tbs", state=s, threshold_reuse=3), 200)
    assert s.searches == 2


def _cupy_kernels():
    from redsync_hvd.core.select import cupy_kernels
    return cupy_kernels.load()


@cuda
@pytest.mark.parametrize("dist", ["gauss", "t3"])
def test_cuda_kernels_agree_with_torch(dist):
    """The CuPy passes count, sum and flag exactly what plain torch ops do."""
    from redsync_hvd.core.select import cupy_kernels as cuda_select
    if _cupy_kernels() is None:
        pytest.skip("CuPy kernels unavailable: %s" % cuda_select.load.error)
    x = sample(dist, 3_000_001).cuda()
    be = cuda_select.CudaPasses(_cupy_kernels(), x, ValueError("bad"))
    mx, mean = be.stats()
    a = x.abs()
    assert mx == float(a.max())
    assert abs(mean - float(a.double().mean())) <= 1e-9 * max(1.0, mean)
    thr = sorted(float(t) for t in torch.rand(20) * mx) + [0.0, mx]
    assert be.count(thr) == [int(torch.count_nonzero(a > t)) for t in
                             torch.tensor(thr, dtype=torch.float32).tolist()]
    x[123457] = float("inf")
    with pytest.raises(ValueError, match="bad"):
        cuda_select.CudaPasses(_cupy_kernels(), x, ValueError("bad")).stats()


@cuda
@pytest.mark.parametrize("method", ["trimmed", "tbs", "sampled"])
def test_cuda_backend_matches_torch_backend(method):
    if _cupy_kernels() is None:
        pytest.skip("CuPy kernels unavailable")
    x = sample("t3", 2_000_000).cuda()
    k = 2000
    a = select_topk(x, k, method, backend="cuda")
    b = select_topk(x, k, method, backend="torch")
    if method == "trimmed":
        assert set(a.tolist()) == set(b.tolist()) == true_topk(x.cpu(), k)
    else:
        check_range(x, a, k)
    with pytest.raises(ValueError, match="backend='cuda' unavailable"):
        select_topk(x.double(), k, method, backend="cuda")


def test_cuda_backend_on_cpu_tensor_is_a_clear_error():
    with pytest.raises(ValueError, match="backend='cuda' unavailable: needs a CUDA float32 tensor"):
        select_topk(torch.randn(1000), 10, "tbs", backend="cuda")


@cuda
@pytest.mark.parametrize("method", ["trimmed", "tbs"])
def test_cuda_histogram_search_edge_cases(method):
    """Mostly zeros (k reaches the zero bin: the exact route), ties, tiny and huge values."""
    x = torch.zeros(1_000_000, device="cuda")
    x[:100] = torch.arange(1, 101, dtype=torch.float32, device="cuda")
    idx = select_topk(x, 500, method)
    assert set(range(100)) <= set(idx.tolist())
    assert (idx.numel() == 500) if method == "trimmed" else (500 <= idx.numel() <= 1000)
    y = torch.full((1_000_000,), 0.5, device="cuda")          # all tied
    n = select_topk(y, 1000, method).numel()
    assert (n == 1000) if method == "trimmed" else (1000 <= n <= 2000)
    z = sample("t3", 1_000_000).cuda() * 1e-30                 # subnormal-adjacent magnitudes
    z[5] = 3e38
    idx = select_topk(z, 1000, method)
    assert 5 in set(idx.tolist())
    if method == "trimmed":
        assert set(idx.tolist()) == true_topk(z.cpu(), 1000)
    else:
        check_range(z, idx, 1000)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ("trimmed", "tbs", "sampled"))
def test_reuse_count_above_band_researches_among_candidates(method, backend):
    """Error feedback grows the residual between searches: a count in (2k, 8k] is
    re-searched among the candidates of the counting pass (exact top-k, no stats pass)."""
    x, k = sample("gauss", 200000, seed=5), 200
    s = SelectionState()
    select_topk(x, k, method, state=s, threshold_reuse=100, backend=backend)
    t = s.threshold
    y = x * 1.15                                   # count above t grows past 2k, stays < 8k
    c = int((y.abs() > t).sum())
    assert 2 * k < c <= 8 * k, c
    idx = select_topk(y, k, method, state=s, threshold_reuse=100, backend=backend)
    assert s.searches == 2 and s.steps_since_search == 0
    if method == "trimmed":
        assert set(idx.tolist()) == true_topk(y, k)    # exactly the top-k
    else:                                              # the ~1.5k above the new threshold
        check_range(y, idx, k)
        assert abs(idx.numel() - 1.5 * k) <= 2
    assert s.threshold > t                             # the new ~1.5k-th value


# ---- the compensation pass fused with the selection's first pass ----------------------

@needs_native
@pytest.mark.parametrize("mode", ["residual", "momentum", "nesterov"])
@pytest.mark.parametrize("n", [1, 9, 4103, 300001])
def test_compensate_scan_equals_the_separate_passes(mode, n):
    m = native.load()
    g = torch.Generator().manual_seed(n)
    r, grad, u = (torch.randn(n, generator=g) for _ in range(3))
    out, u_out = torch.empty(n), torch.empty(n)
    if mode == "residual":
        ref, uu, uo = r + grad, torch.empty(0), torch.empty(0)
    else:
        un = torch.add(grad, u, alpha=0.9)
        ref = r + (grad + 0.9 * un if mode == "nesterov" else un)
        uu, uo = u, u_out
    thr = float(ref.abs().median())
    idx, vals, c, finite, mx, s = m.compensate_scan(r, grad, out, uu, uo, 0.9, mode == "nesterov", thr, n)
    if mode == "residual":
        assert torch.equal(out, ref)
    else:   # torch may fuse m*u + g into one rounding (FMA): one ulp apart at most
        assert torch.allclose(u_out, un, rtol=1e-6, atol=1e-6) and torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    ref_idx, ref_vals, ref_c, _ = m.select_above(out, thr, n, True, True)
    assert finite and c == ref_c and torch.equal(idx, ref_idx) and torch.equal(vals, ref_vals)
    ref_mx, ref_s = m.stats(out)
    assert mx == ref_mx and math.isclose(s, ref_s, rel_tol=1e-6)
    # past the cap: the count only; no threshold: statistics only
    idx, vals, c, *_ = m.compensate_scan(r, grad, out, uu, uo, 0.9, mode == "nesterov", thr, ref_c - 1)
    assert idx.numel() == 0 and c == ref_c
    idx, _, c, finite, mx, _ = m.compensate_scan(r, grad, out, uu, uo, 0.9, mode == "nesterov", math.inf, n)
    assert idx.numel() == 0 and c == 0 and finite and mx == ref_mx
    for bad in (float("nan"), float("inf")):
        grad[n // 2] = bad
        assert not m.compensate_scan(r, grad, out, uu, uo, 0.9, mode == "nesterov", thr, n)[3]
        assert not m.compensate_scan(r, grad, out, uu, uo, 0.9, mode == "nesterov", math.inf, n)[3]


@needs_native
@pytest.mark.parametrize("method", ("tbs", "trimmed", "sampled"))
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_selection_from_the_fused_pass_equals_the_unfused_one(method, momentum):
    """Error feedback over 12 steps, threshold reuse 4: the memory that fuses the first
    selection pass into its compensation sends exactly what the unfused pair sends (sampled:
    the pass emits above the threshold of DGC's sample, taken from r + g first)."""
    from redsync_hvd.core.select import scan_request
    from redsync_hvd.memory import MomentumCorrectionMemory, ResidualMemory

    def memory():
        return MomentumCorrectionMemory(momentum) if momentum else ResidualMemory()

    fused, plain = memory(), memory()
    s_fused, s_plain = SelectionState(), SelectionState()
    k, g = 300, torch.Generator().manual_seed(3)
    used = 0
    for step in range(12):
        grad = torch.randn(200003, generator=g) * (1 + 0.05 * step)
        req = scan_request(s_fused, k, Contract(method, threshold_reuse=4), grad.numel())
        x_f, first, _ = fused.compensate("w", grad, req)
        x_p = plain.compensate("w", grad).x
        if momentum == 0.0:
            assert torch.equal(x_f, x_p)
        assert req is not None and first is not None
        used += first.count > 0
        a = select_topk(x_f, k, method, state=s_fused, threshold_reuse=4, scan=first)
        b = select_topk(x_p if momentum == 0.0 else x_f.clone(), k, method, state=s_plain, threshold_reuse=4)
        assert torch.equal(a, b)
        assert s_fused.state_dict() == s_plain.state_dict()
        for mem, x, idx in ((fused, x_f, a), (plain, x_p, b)):
            x[idx] = 0.0
            mem.mask("w", idx)
            mem.commit()
    assert used >= 6   # most steps took their hits from the fused pass


@needs_native
def test_dgc_sampled_selection_takes_its_hits_from_the_compensating_pass():
    """Without threshold reuse, DGC's sampled threshold is taken from r + g before x is written,
    and the compensating pass emits above it: the selection reads x no more (its own index pass
    would find the same hits) and returns what the unfused selection returns."""
    from redsync_hvd.core.select import scan_request
    from redsync_hvd.core.select.native import compensate_scan
    n, k, g = 300_001, 300, torch.Generator().manual_seed(5)
    r, grad, out = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.empty(n)
    scan = compensate_scan(r, grad, out, scan_request(None, k, Contract("sampled", sample_fraction=0.01), n))
    assert scan is not None and k <= scan.count == scan.indices.numel() < 2 * k
    assert torch.equal(out, r + grad)
    assert torch.equal(select_topk(out, k, "sampled", scan=scan), select_topk(out.clone(), k, "sampled"))
    assert math.isnan(scan.threshold)   # consumed: the selection made no pass of its own


def test_exact_over_equal_segments_is_one_batched_topk_with_every_segments_answer():
    """Many segments of one size and k (DCT blocks, compressors/dct.py) take one batched top-k: the
    same positions, segment-local, as selecting one segment at a time; NaN still refused."""
    from redsync_hvd.core.segments import Segments
    count, size, k = 37, 256, 5
    x = torch.randn(count * size, generator=torch.Generator().manual_seed(4))
    sel = select(Segments([size] * count, [k] * count), x, Contract("exact"))
    assert sel.counts == (k,) * count
    for i, got in enumerate(sel.positions.reshape(count, k)):
        want = torch.topk(x[i * size:(i + 1) * size].abs(), k).indices
        assert set(got.tolist()) == set(want.tolist()), i
    ties = torch.randint(-3, 4, (count * size,), generator=torch.Generator().manual_seed(5)).float()
    rows = select(Segments([size] * count, [k] * count), ties, Contract("exact", finite=False)).positions
    one_by_one = [torch.topk(v.abs(), k, sorted=False).indices for v in ties.reshape(count, size)]
    assert torch.equal(rows, torch.cat(one_by_one))   # the same order, ties broken alike
    x[3 * size + 7] = float("nan")
    with pytest.raises(NonFiniteError):
        select(Segments([size] * count, [k] * count), x, Contract("exact"), name="w")


@settings(max_examples=300, deadline=None)
@example([1.0, -1.0, 0.5, -0.5], "larger")   # a tie: the positive side
@example([3e38, 3e38, -1.0], "larger")       # the positive sum overflows fp32
@example([0.0, -0.0], "larger")
@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 3.0, -3.0, 1e-30, -1e-30, 1e30, -1e30, 3e38, -3e38])
                | st.floats(-1e6, 1e6, width=32), max_size=64),
       st.sampled_from(["larger", "pos", "neg", None]))
def test_sign_rule_and_kept_mean_on_the_host_decide_as_the_device_expressions(values, sign):
    """With ``host`` (the CPU's per-layer codec) ``keep_side`` reads the two sides' fp32 sums and counts
    and compares their means on the host, and ``kept_mean`` computes the float64 mean only where the fp32
    one overflowed: both give the device expressions' bits, ties (equal means) and overflowing sums
    included."""
    from redsync_hvd.core.select.reference import keep_side, kept_mean
    from redsync_hvd.core.wire import widen
    x = torch.tensor(values, dtype=torch.float32)
    pos, neg = x > 0, x < 0
    if sign == "larger":   # the expression keep_side evaluates off the CPU, without a host read
        mu_pos = torch.where(pos, x, 0.0).sum() / pos.count_nonzero().clamp(min=1)
        mu_neg = -torch.where(neg, x, 0.0).sum() / neg.count_nonzero().clamp(min=1)
        expect = torch.where(mu_pos >= mu_neg, pos, neg)
    else:
        expect = {"pos": pos, "neg": neg, None: pos | neg}[sign]
    for host in (False, True):
        assert torch.equal(keep_side(x, sign, host=host), expect), host
    kept = x[expect]
    mean = widen(kept.mean(dtype=torch.float32), kept.mean(dtype=torch.float64)).reshape(1) if kept.numel() \
        else torch.zeros(1)
    for host in (False, True):
        assert torch.equal(kept_mean(kept, host=host).view(torch.int32), mean.view(torch.int32)), host


@needs_native
def test_select_density_experiment_reports_the_share_it_asked_for(monkeypatch, capsys):
    """experiments/select_density.py: the pass emits the share of |x| its threshold leaves above it."""
    from redsync_hvd.experiments import select_density
    monkeypatch.setattr("sys.argv", ["select_density", "--numel", "70000", "--densities", "0.1,0.5", "--repeats", "2"])
    select_density.main()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].split(",")[0].strip() for line in lines] == ["7000 hits", "35000 hits"], lines
