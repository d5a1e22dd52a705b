"""Exact-k selection over a bucket (core/select/radix.py): the torch reference path.

Checked against a plain sort (the k largest keys, ties broken by position), for every sign
rule; conservation of the gradient under error feedback; NaN/Inf flags per layer; and a
count of the ops that would make the host wait on a GPU: none, for 2, 8 and 60 layers.
The Triton kernels are compared with this reference in tests/test_triton_select.py.
"""
import inspect

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from redsync_hvd.core.host_reads import HostReads
from redsync_hvd.core.segments import Segments, auto_tile
from redsync_hvd.core.select import Contract, HistogramRequest, compensate, decode_add, select
from redsync_hvd.core.select.contract import SIGNS

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RADIX, TORCH = Contract("radix"), Contract("radix", backend="torch")


def bucket(sizes, seed, kind="gauss", device="cpu"):
    """A flat float32 bucket: Gaussian, heavy-tailed, or with many ties (few distinct values)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), generator=gen)
    if kind == "heavy":
        x = x ** 3
    elif kind == "ties":
        x = torch.round(x * 2) / 2      # 0, +-0.5, +-1, ...: whole layers of equal keys
    elif kind == "zeros":
        x = torch.where(torch.rand(x.shape, generator=gen) < 0.7, 0.0, x)
    return x.to(device)


def sort_reference(x, seg, sign):
    """Per layer: a stable sort of the keys, the first k, ascending; SBC's side by its mean key."""
    out = []
    for i, k in enumerate(seg.ks):
        v = x[seg.offsets[i]:seg.offsets[i] + seg.sizes[i]].cpu()
        key = v.abs().double()
        pos, neg = torch.where(v.view(torch.int32) < 0, 0.0, key), torch.where(v.view(torch.int32) < 0, key, 0.0)

        def top(keys, k=k):
            return torch.sort(torch.sort(keys, descending=True, stable=True).indices[:k]).values
        if sign is None:
            out.append(top(key))
        elif sign == "pos":
            out.append(top(pos))
        elif sign == "neg":
            out.append(top(neg))
        else:
            p, q = top(pos), top(neg)
            mp, mq = pos[p].sum() / max(k, 1), neg[q].sum() / max(k, 1)
            close = abs(float(mp - mq)) <= 1e-12 * max(float(mp), float(mq), 1e-300)
            out.append((p, q) if close else (q if mq > mp else p))
    return out


def assert_exact(sel, x, seg, sign):
    ref = sort_reference(x, seg, sign)
    pos = sel.positions.cpu().long()
    for i, want in enumerate(ref):
        got = pos[seg.kofs[i]:seg.kofs[i + 1]]
        if isinstance(want, tuple):     # SBC's two sides tie: either is right
            assert torch.equal(got, want[0]) or torch.equal(got, want[1]), i
        else:
            assert torch.equal(got, want), (i, got[:8], want[:8])


layers = st.lists(st.integers(0, 2500), min_size=1, max_size=6)


def padded(seg, x, fill=0.0):
    """The layers of the flat x in seg's layout, its padding set to ``fill``."""
    out = torch.full((seg.n,), fill, device=x.device)
    for view, layer in zip(seg.views(out), torch.split(x, list(seg.sizes))):
        view.copy_(layer)
    return out


@settings(max_examples=60, deadline=None)
@given(sizes=layers, fracs=st.lists(st.floats(0, 1), min_size=6, max_size=6), seed=st.integers(0, 10 ** 6),
       kind=st.sampled_from(["gauss", "heavy", "ties", "zeros"]), sign=st.sampled_from(SIGNS),
       tile=st.sampled_from([16, 256, 0]), align=st.sampled_from([1, 16]))
def test_exactly_the_k_largest_keys_ties_by_position(sizes, fracs, seed, kind, sign, tile, align):
    """Padding (NaN here, with align=16) is never read as data."""
    ks = [round(f * n) for f, n in zip(fracs, sizes)]
    seg = Segments(sizes, ks, tile=tile, align=align)
    x = padded(seg, bucket(sizes, seed, kind), float("nan"))
    sel = select(seg, x, TORCH, sign=sign, mean=sign is not None)
    assert sel.positions.shape == (sum(ks),) and sel.positions.dtype == torch.int32
    assert_exact(sel, x, seg, sign)
    assert not sel.nonfinite.any()
    for i, k in enumerate(ks):
        v = x[seg.offsets[i]:seg.offsets[i] + seg.sizes[i]]
        got = sel.positions[seg.kofs[i]:seg.kofs[i + 1]].long()
        key = v.abs() if sign is None else torch.where((v < 0) == bool(sel.side[i]), v.abs(), 0.0)
        if k:   # kth: the k-th largest key of the kept side
            assert sel.kth[i].view(torch.float32) == torch.sort(key, descending=True).values[k - 1]
        if sign is not None:   # the mean of the kept side's magnitudes, signed by the side
            expect = key[got].double().sum() / max(k, 1) * (-1 if sel.side[i] else 1)
            assert torch.allclose(sel.means[i].double(), expect, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_layers", [2, 8, 60])
def test_many_layers_tiny_ones_and_k_near_n(device, n_layers):
    gen = torch.Generator().manual_seed(n_layers)
    sizes = [int(s) for s in torch.randint(1, 4000, (n_layers,), generator=gen)]
    sizes[0], sizes[-1] = 1, 7                       # tiny layers
    ks = [max(1, n // 100) for n in sizes]
    ks[1] = sizes[1] - 1                             # k close to n
    ks[-1] = sizes[-1]                               # k == n: everything
    seg = Segments(sizes, ks, tile=512)
    x = bucket(sizes, n_layers, "ties" if n_layers == 8 else "gauss", device)
    for sign in SIGNS:
        assert_exact(select(seg, x, TORCH, sign=sign), x, seg, sign)


def conservation_run(backend, device, *, sign, mean, value_dtype, grad_dtype, momentum, steps=3):
    """Several steps of compensate -> select(update) -> decode of the own message: what was
    sent plus what is kept equals everything that came in (DGC: the velocities); layers
    aligned to 16 elements."""
    sizes, ks = [3000, 17, 800, 1], [30, 17, 8, 1]
    seg = Segments(sizes, ks, tile=256, align=16)
    n, gen, c = seg.n, torch.Generator().manual_seed(7), Contract("radix", backend=backend)
    r, u = torch.zeros(n, device=device), torch.zeros(n, device=device)
    total = torch.zeros(n, dtype=torch.float64, device=device)
    sent = torch.zeros(n, dtype=torch.float64, device=device)
    for _ in range(steps):
        g = padded(seg, torch.randn(sum(sizes), generator=gen)).to(device, grad_dtype)   # the padding holds 0
        x, u_new = torch.empty(n, device=device), torch.empty(n, device=device)
        hist = compensate(r, g, x, velocity=u if momentum else None, velocity_out=u_new if momentum else None,
                          momentum=momentum, first=HistogramRequest(seg, sign, c))
        total += (u_new if momentum else g.float()).double()
        before = x.clone()
        sel = select(seg, x, c, sign=sign, mean=mean, first=hist,
                     value_dtype=value_dtype, update=True, velocity=u_new if momentum else None)
        own = torch.zeros(n, device=device)
        decode_add(seg, own, sel.positions, sel.values, means=sel.means, contract=c)
        if mean or value_dtype == torch.float32:   # the fp32 values leave exactly 0 behind
            assert torch.equal(x[own != 0], (before - own)[own != 0])
        assert torch.equal(own.double() + x.double(), before.double()) or mean
        assert torch.allclose(own.double() + x.double(), before.double(), rtol=0, atol=1e-6)
        sent += own.double()
        r, u = x, u_new
    assert torch.allclose(sent + r.double(), total, rtol=0, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sign,mean,value_dtype", [(None, False, torch.float32), (None, False, torch.float16),
                                                   ("pos", True, torch.float32), ("neg", True, torch.float32),
                                                   ("larger", True, torch.float32), ("larger", False, torch.bfloat16)])
@pytest.mark.parametrize("grad_dtype,momentum", [(torch.float32, 0.0), (torch.float16, 0.9), (torch.bfloat16, 0.0)])
def test_sent_plus_residual_is_what_came_in(device, sign, mean, value_dtype, grad_dtype, momentum):
    conservation_run("torch", device, sign=sign, mean=mean, value_dtype=value_dtype, grad_dtype=grad_dtype,
                     momentum=momentum)


@pytest.mark.parametrize("sign", SIGNS)
def test_nonfinite_is_flagged_per_layer_and_the_result_stays_well_formed(sign):
    sizes, ks = [500, 300, 400, 200, 100], [5, 3, 4, 2, 100]
    seg = Segments(sizes, ks, tile=128)
    x = bucket(sizes, 3)
    x[510], x[900], x[1350], x[1450] = float("nan"), float("inf"), -float("inf"), -float("nan")
    sel = select(seg, x, TORCH, sign=sign, mean=sign is not None)
    assert sel.nonfinite.tolist() == [False, True, True, True, True]
    for i, k in enumerate(ks):
        p = sel.positions[seg.kofs[i]:seg.kofs[i + 1]].long()
        assert p.numel() == k and (p[1:] > p[:-1]).all() and (p >= 0).all() and (p < sizes[i]).all()


def test_decode_adds_every_rank_in_order_and_masks_the_velocity():
    seg = Segments([1000, 3, 2000], [10, 3, 20], tile=256)
    gen = torch.Generator().manual_seed(1)
    msgs = [select(seg, torch.randn(seg.n, generator=gen), TORCH) for _ in range(3)]
    pos = torch.stack([m.positions for m in msgs])
    vals = torch.stack([m.values for m in msgs]).half()
    out, zero = torch.randn(seg.n, generator=gen), torch.ones(seg.n)
    want = out.clone()
    for r in range(3):                        # one rank after another, in float32
        for i in range(len(seg)):
            a, b = seg.kofs[i], seg.kofs[i + 1]
            for p, v in zip(pos[r, a:b].tolist(), vals[r, a:b].float().tolist()):
                want[seg.offsets[i] + p] += torch.tensor(v) * 0.25
    decode_add(seg, out, pos, vals, alpha=0.25, zero=zero, contract=TORCH)
    assert torch.equal(out, want)
    assert int((zero == 0).sum()) == len({
        (i, p) for r in range(3) for i in range(len(seg)) for p in pos[r, seg.kofs[i]:seg.kofs[i + 1]].tolist()})
    means = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [0.5, 0.5, 0.5]])
    out = torch.zeros(seg.n)
    decode_add(seg, out, pos, means=means, contract=TORCH)
    assert out[1000:1003].tolist() == [22.5] * 3      # every rank sends all 3 of layer 1: 2 + 20 + 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_layers", [2, 8, 60])
def test_no_host_wait_in_a_compressed_step(device, n_layers):
    """compensate (DGC momentum), select with the residual update and velocity masking, and
    the decode of gathered messages read nothing back, from a fresh layout on (its tables are
    built inside the count too)."""
    sizes = [5000 + 37 * i for i in range(n_layers)]
    seg = Segments(sizes, [n // 100 for n in sizes], tile=1024)
    gen = torch.Generator().manual_seed(0)
    r, u, g = (torch.randn(seg.n, generator=gen).to(device) for _ in range(3))
    x, u_new, avg = torch.empty_like(r), torch.empty_like(r), torch.zeros_like(r)
    with HostReads() as reads:
        for sign, mean in ((None, False), ("pos", True), ("larger", True)):
            hist = compensate(r, g.half(), x, velocity=u, velocity_out=u_new, momentum=0.9,
                              first=HistogramRequest(seg, sign, TORCH))
            sel = select(seg, x, TORCH, sign=sign, mean=mean, first=hist, update=True, velocity=u_new)
            wire = {"means": torch.stack([sel.means] * 4)} if mean else {"values": torch.stack([sel.values] * 4)}
            decode_add(seg, avg, torch.stack([sel.positions] * 4), alpha=0.25, **wire, contract=TORCH)
    assert reads.events == []
    with HostReads() as reads:      # the count can fail: it sees a wait when there is one
        torch.nonzero(x)
        x.sum().item()
    assert [op for op, _ in reads.events] == ["aten::nonzero", "item"]


def test_no_host_read_in_the_sources():
    """The count above sees the branches those inputs took; the sources must have no host read on any other."""
    from redsync_hvd.core import segments
    from redsync_hvd.core.select import radix, radix_ref
    for mod in (radix, radix_ref, segments):
        src = inspect.getsource(mod)
        for bad in (".item()", ".tolist()", "nonzero(", ".cpu()", "bool(", ".numpy()"):
            assert bad not in src, (mod.__name__, bad)


def test_layout_and_bad_input():
    seg = Segments([10, 0, 5000, 3], [1, 0, 50, 3], tile=1024)
    tab = seg.tables("cpu")
    assert seg.offsets == (0, 10, 10, 5010, 5013) and seg.kofs == (0, 1, 1, 51, 54) and seg.k_total == 54
    # every layer has a tile, an empty one for a layer of 0 elements
    assert tab.tile_seg.tolist() == [0, 1, 2, 2, 2, 2, 2, 3] and tab.seg_tile.tolist() == [0, 1, 2, 7, 8]
    assert tab.tile_hi.tolist() == [10, 10, 1034, 2058, 3082, 4106, 5010, 5013]
    aligned = Segments([10, 0, 5000, 3], [1, 0, 50, 3], tile=1024, align=16)
    assert aligned.offsets == (0, 16, 16, 5024, 5040) and aligned.n == 5040 and aligned.padded
    tab = aligned.tables("cpu")
    assert tab.tile_lo.tolist() == [0, 16, 16, 1040, 2064, 3088, 4112, 5024]     # starts: multiples of 16
    assert tab.tile_hi.tolist() == [10, 16, 1040, 2064, 3088, 4112, 5016, 5027]  # ends: the real elements'
    assert [v.numel() for v in aligned.views(torch.zeros(aligned.n))] == [10, 0, 5000, 3]
    assert auto_tile(1 << 20) == 8192 and auto_tile(1 << 24) == 32768 and auto_tile(1 << 26) == 65536
    x = torch.zeros(seg.n)
    with pytest.raises(ValueError, match="layer 1 has size 4 and k 5"):
        Segments([4, 4], [1, 5])
    with pytest.raises(ValueError, match="one k per layer"):
        Segments([4, 4], [1])
    with pytest.raises(ValueError, match="sign='both' is not one of"):
        select(seg, x, RADIX, sign="both")
    with pytest.raises(ValueError, match="needs sign="):
        select(seg, x, RADIX, mean=True)
    with pytest.raises(ValueError, match="x: need a contiguous 1-D tensor of 5013"):
        select(seg, x[:100], RADIX)
    with pytest.raises(ValueError, match=r"first: need the \(8, 256\) int32 histogram"):
        select(seg, x, RADIX, sign="pos", first=torch.zeros(4, 4096, dtype=torch.int32))
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        select(seg, x, Contract("radix", backend="cuda"))
    with pytest.raises(ValueError, match="exactly one of values"):
        decode_add(seg, x, torch.zeros(54, dtype=torch.int32), contract=RADIX)
    with pytest.raises(ValueError, match="velocity masking comes with update=True"):
        select(seg, x, RADIX, velocity=torch.zeros(seg.n))
