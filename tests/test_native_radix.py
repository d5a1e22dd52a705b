"""The CPU backend of the radix select (core/select/native_radix.py) against the torch reference.

It must give what the reference gives, to the bit: positions, values as they travel, means, the
k-th key, the side and the non-finite flags, and x and the velocity after the update. Its layers
of 2**16 elements and more take the candidates path (a threshold set from the native passes);
smaller ones, and those it cannot narrow (NaN/Inf, too few of a sign), go to the reference whole.
"""
import pytest
import torch

from redsync_hvd.core.segments import Segments
from redsync_hvd.core.select import Contract, compensate, native_radix, select
from redsync_hvd.core.select.radix import HistogramRequest
from redsync_hvd.core.select.registry import pick

pytestmark = pytest.mark.skipif(not native_radix.native.available(), reason="the native CPU kernels are not built")

NATIVE, TORCH = Contract.of("radix", backend="native"), Contract.of("radix", backend="torch")
BIG = 1 << 16


def bucket(seg, seed, kind):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seg.n, generator=gen) * torch.rand(seg.n, generator=gen) ** 3
    if kind == "heavy":
        x = x ** 3
    elif kind == "ties":
        x = torch.round(x * 8) / 8                         # few distinct keys: many ties at the k-th
    elif kind == "one_sided":
        x = x.abs()                                        # no negative element: "neg" cannot narrow
        x[:5] = -1e-3
    return x


def both(seg, x, velocity, **ask):
    """(Selection, x after, velocity after) from the native backend and from the reference."""
    out = []
    for contract in (NATIVE, TORCH):
        xx, vv = x.clone(), None if velocity is None else velocity.clone()
        sel = select(seg, xx, contract, velocity=vv, **ask)
        out.append((sel, xx, vv))
    return out


def bits(t):
    """t as its bits (NaN equal to the same NaN), for a comparison to the bit."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def assert_same(a, b):
    (sa, xa, va), (sb, xb, vb) = a, b
    for field in ("positions", "values", "means", "kth", "side", "nonfinite"):
        fa, fb = getattr(sa, field), getattr(sb, field)
        assert (fa is None) == (fb is None), field
        if fa is not None:
            assert fa.dtype == fb.dtype and torch.equal(bits(fa), bits(fb)), field
    assert torch.equal(bits(xa), bits(xb))
    assert va is None or torch.equal(va, vb)


LAYOUT = Segments([BIG + 37, 300, 0, 3 * BIG, 2 * BIG, 5000], [65, 3, 0, 200, 0, 50], align=16)


@pytest.mark.parametrize("kind", ["gauss", "heavy", "ties"])
@pytest.mark.parametrize("sign,mean", [(None, False), ("pos", False), ("neg", True), ("larger", False),
                                       ("larger", True)])
def test_native_equals_the_reference(kind, sign, mean):
    x = bucket(LAYOUT, 3, kind)
    velocity = torch.randn(LAYOUT.n, generator=torch.Generator().manual_seed(4))
    assert_same(*both(LAYOUT, x, velocity, sign=sign, mean=mean, update=True, value_dtype=torch.float16))
    assert_same(*both(LAYOUT, x, None, sign=sign, mean=mean, index_dtype=torch.int64))


def test_layers_it_cannot_narrow_go_whole():
    """NaN in one big layer and Inf in another (flagged, nothing raised), and a layer with fewer
    negatives than k under "neg": the same as the reference."""
    seg = Segments([2 * BIG, 2 * BIG, 2 * BIG], [100, 100, 100])
    x = bucket(seg, 5, "one_sided")
    x[10] = float("nan")
    x[2 * BIG + 7] = float("inf")
    for sign in (None, "neg", "larger"):
        a, b = both(seg, x, None, sign=sign, mean=sign is not None, update=True)
        assert_same(a, b)
        assert a[0].nonfinite.tolist() == [True, True, False]


def test_the_candidates_hold_every_element_at_or_above_the_kth():
    v = bucket(Segments([4 * BIG], [0]), 6, "ties")
    k = 500
    cand = native_radix._candidates(native_radix.native.load(), v, k, 1, (0,))
    kth = v.abs().topk(k).values.min()
    assert cand is not None and cand.numel() >= k and bool((cand[1:] > cand[:-1]).all())
    assert set(torch.nonzero(v.abs() >= kth).flatten().tolist()) <= set(cand.tolist())


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_compensate_is_the_references_without_a_histogram(momentum, nesterov):
    """x and the velocity to the bit, and each large layer's sign statistics for the candidates."""
    gen = torch.Generator().manual_seed(7)
    r, g, u = (torch.randn(LAYOUT.n, generator=gen) for _ in range(3))
    outs = []
    for contract in (NATIVE, TORCH):
        out, u_out = torch.empty(LAYOUT.n), torch.empty(LAYOUT.n)
        first = compensate(r, g, out, velocity=u if momentum else None, velocity_out=u_out if momentum else None,
                           momentum=momentum, nesterov=nesterov, first=HistogramRequest(LAYOUT, None, contract))
        outs.append((first, out, u_out))
    assert torch.is_tensor(outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    assert not momentum or torch.equal(outs[0][2], outs[1][2])
    # the native kernel's statistics of each large layer are the stats passes' over the x it wrote
    m = native_radix.native.load()
    for view, stats in zip(LAYOUT.views(outs[0][1]), outs[0][0]):
        if view.numel() < BIG:
            assert stats is None
        else:
            assert stats == (True, *m.stats(view.contiguous(), 1), *m.stats(view.contiguous(), -1))


def test_auto_picks_it_on_a_cpu_float32_bucket():
    assert pick("radix", "cpu", torch.float32, 1 << 24)[0].name == "native"
    assert pick("radix", "cpu", torch.float32, 1 << 24, "torch")[0].name == "torch"


@pytest.mark.parametrize("side", [1, -1])
def test_the_passes_rank_one_sides_keys_and_check_all_of_x(side):
    """side 1 / -1: the stats, count and select passes rank max(x, 0) / max(-x, 0) as the same
    passes rank a copy of x clamped to that side (tails of every length, +-0 and the other sign
    give 0); the finite check still sees a NaN or Inf on the other side."""
    m = native_radix.native.load()
    gen = torch.Generator().manual_seed(7)
    for n in (300001, 4099, 31):
        x = torch.randn(n, generator=gen)
        x[::97], x[1::89] = 0.0, -0.0
        keys = (x * side).clamp(min=0.0)
        assert m.stats(x, side) == m.stats(keys)
        thr = torch.tensor([0.0, 0.4, 1.5, 9.0])
        assert m.count_multi(x, thr, side).tolist() == m.count_multi(keys, thr).tolist()
        for cap in (10**9, 5):
            got, ref = m.select_above(x, 0.7, cap, True, True, side), m.select_above(keys, 0.7, cap, True, True)
            assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(got, ref))
    # NaN of either sign bit, and an Inf on the side the keys set to 0
    for bad_bits in (0x7FC00000, -0x400000, 0x7F800000 if side < 0 else -0x800000):
        y = torch.randn(70000, generator=gen).abs() * side
        y.view(torch.int32)[4321] = bad_bits
        assert not m.select_above(y, 0.5, 10**9, True, False, side)[3]
        assert m.stats(y, side)[1] == float("inf")
    with pytest.raises(RuntimeError, match="side"):
        m.stats(torch.randn(10, dtype=torch.float64), 1)
    with pytest.raises(RuntimeError, match="side"):
        m.count_multi(torch.randn(10), torch.tensor([0.5]), 2)


@pytest.mark.parametrize("sign,mean", [(None, False), ("pos", True), ("neg", False), ("larger", True)])
def test_compensate_then_select_from_its_statistics(sign, mean, monkeypatch):
    """The exchange's order: compensate (the native kernel's sign statistics per layer), then select
    from them, with DGC's momentum, a NaN in one large layer and fewer negatives than k in another:
    what compensate and select give with the reference on both, to the bit, and no statistics
    pass of its own but for the layer whose NaN sends it to the reference."""
    real, passes = native_radix.native.load(), []

    class Counting:
        def __getattr__(self, name):
            passes.append(name)
            return getattr(real, name)
    monkeypatch.setattr(native_radix.native, "load", lambda: Counting())
    seg = Segments([3 * BIG, 300, 2 * BIG, 2 * BIG + 5], [150, 3, 100, 80], align=16)
    gen = torch.Generator().manual_seed(11)
    r, g, u = (torch.randn(seg.n, generator=gen) for _ in range(3))
    r[seg.offsets[2] + 17] = float("nan")
    r[seg.offsets[3]:seg.offsets[3] + seg.sizes[3]] = torch.rand(seg.sizes[3], generator=gen) * 9 + 3   # g can't flip
    got = []
    for contract in (NATIVE, TORCH):
        out, u_out = torch.empty(seg.n), torch.empty(seg.n)
        first = compensate(r, g, out, velocity=u, velocity_out=u_out, momentum=0.9,
                           first=HistogramRequest(seg, sign, contract))
        sel = select(seg, out, contract, sign=sign, mean=mean, first=first, update=True, velocity=u_out)
        got.append((sel, out, u_out))
    assert isinstance(got[0][0], type(got[1][0]))
    assert_same(*got)
    assert got[0][0].nonfinite.tolist() == [False, False, True, False]
    assert passes.count("compensate_sides") == 3 and "stats" not in passes, " ".join(passes)


@pytest.mark.parametrize("sign,mean", [(None, False), ("pos", True), ("larger", True)])
def test_a_step_started_from_the_last_kth_key_gives_the_references_selection(sign, mean, monkeypatch):
    """With a hints dict kept across steps (as a planned bucket keeps it), a large layer whose k-th
    key has held steady starts from it: one index pass above HINT_MARGIN times it. Every step's
    selection and update equal the reference's to the bit, whichever path ran: steady steps (the
    hint finds the candidates), |x| shrunk 10x (too few above the hint: the search runs), the
    step after (the key moved: no hint tried), grown back 10x (too many) and a NaN (that layer
    goes to the reference whole)."""
    taken = []
    real = native_radix._from_hint

    def spy(*a):
        got = real(*a)
        if a[-1] is not None:
            taken.append(got is not None)
        return got
    monkeypatch.setattr(native_radix, "_from_hint", spy)
    seg = Segments([3 * BIG, 300, 2 * BIG], [150, 3, 100], align=16)
    gen, hints = torch.Generator().manual_seed(13), {}
    sides = 2 if sign == "larger" else 1
    hit, miss = [True] * sides, [False] * sides   # per large layer: one try per side selected from
    # step 8: the NaN's layer stops at its first side's miss (x is not finite: the reference takes it)
    expect = {0: [], 1: [], 2: hit + hit, 3: miss + miss, 4: [], 5: hit + hit, 6: miss + miss, 7: [], 8: hit + [False]}
    for step, scale in enumerate([1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 1.0, 1.0, 1.0]):
        x = torch.randn(seg.n, generator=gen) * scale   # a fresh gradient: the k-th key holds steady
        if step == 8:
            x[seg.offsets[2] + 5] = float("nan")
        taken.clear()
        got = [(select(seg, xx, contract, sign=sign, mean=mean, update=True, state=state), xx, None)
               for xx, contract, state in ((x.clone(), NATIVE, hints), (x.clone(), TORCH, None))]
        assert_same(*got)
        assert taken == expect.get(step, taken), (step, taken)
    assert got[0][0].nonfinite.tolist() == [False, False, True]
    assert {key[0] for key in hints} == {3 * BIG, 2 * BIG}
