"""The Triton kernels (core/select/triton_select.py) against the torch reference, bit for bit.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported) on CPU tensors: slow, so the inputs stay small (a few thousand to tens
of thousands of elements) but still span several tiles per layer. With CUDA the same tests
run the compiled kernels on the GPU.
"""
import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"     # must precede the first import of triton

import hypothesis.strategies as st  # noqa: E402
import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402

from redsync_hvd.core.segments import Segments  # noqa: E402
from redsync_hvd.core.select import Contract, HistogramRequest, compensate, decode_add, select  # noqa: E402
from redsync_hvd.core.select.contract import SIGNS  # noqa: E402
from redsync_hvd.core.select.radix import k_rows  # noqa: E402

try:
    import triton  # noqa: F401

    from redsync_hvd.core.select import triton_select  # noqa: F401
    _WHY = ""
except ImportError as e:     # pragma: no cover - CI installs the 'kernels' extra
    _WHY = f"triton cannot be imported ({e}); install it: pip install -e .[kernels]"
pytestmark = pytest.mark.skipif(bool(_WHY), reason=_WHY or "triton present")

DEV = "cuda" if CUDA else "cpu"
RADIX, TORCH, TRITON = Contract("radix"), Contract("radix", backend="torch"), Contract("radix", backend="triton")
FIELDS = ("positions", "values", "nonfinite", "kth", "side")


def bucket(sizes, seed, kind):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), generator=gen)
    if kind == "ties":
        x = torch.round(x * 2) / 2
    elif kind == "heavy":
        x = x ** 3
    return x.to(DEV)


def padded(seg, x, fill=0.0):
    """The layers of the flat x in seg's layout (its padding set to ``fill``)."""
    out = torch.full((seg.n,), fill, device=x.device)
    for view, layer in zip(seg.views(out), torch.split(x, list(seg.sizes))):
        view.copy_(layer)
    return out


def same(a, b):
    """Equal bit for bit (NaN included), or both None."""
    if a is None or b is None:
        return a is None and b is None
    if a.is_floating_point():
        return torch.equal(a.float().view(torch.int32), b.float().view(torch.int32))
    return torch.equal(a, b)


def both(seg, x, **kw):
    """(reference, triton) selections and the x each left behind (update=True mutates x)."""
    xa, xb = x.clone(), x.clone()
    ua = kw.pop("velocity", None)
    ub = None if ua is None else ua.clone()
    a = select(seg, xa, TORCH, velocity=ua, **kw)
    b = select(seg, xb, TRITON, velocity=ub, **kw)
    return a, b, (xa, xb), (ua, ub)


def assert_same(a, b, mean_rtol=1e-6):
    for f in FIELDS:
        assert same(getattr(a, f), getattr(b, f)), f
    if a.means is not None:    # float64 sums in another order: equal up to the last float32 bit
        assert torch.allclose(a.means, b.means, rtol=mean_rtol, atol=0, equal_nan=True)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(0, 2500), min_size=1, max_size=3),
       fracs=st.lists(st.sampled_from([0.0, 0.001, 0.01, 0.3, 0.99, 1.0]), min_size=3, max_size=3),
       seed=st.integers(0, 10 ** 6), kind=st.sampled_from(["gauss", "ties", "heavy"]),
       sign=st.sampled_from(SIGNS), tile=st.sampled_from([512, 1024]), align=st.sampled_from([1, 16]))
@example(sizes=[2500, 3, 1800], fracs=[0.01, 1.0, 0.3], seed=1, kind="ties", sign="larger", tile=512, align=16)
@example(sizes=[2400, 1], fracs=[0.99, 1.0], seed=2, kind="heavy", sign="neg", tile=512, align=1)
def test_triton_equals_the_reference(sizes, fracs, seed, kind, sign, tile, align):
    seg = Segments(sizes, [round(f * n) for f, n in zip(fracs, sizes)], tile=tile, align=align)
    x = padded(seg, bucket(sizes, seed, kind))
    a, b, (xa, xb), _ = both(seg, x, sign=sign, mean=sign not in (None, "larger"), update=True)
    assert_same(a, b)
    assert same(xa, xb), "the residual update"


@pytest.mark.parametrize("sign,mean,value_dtype,index_dtype", [
    ("pos", True, torch.float32, torch.int32), ("neg", False, torch.float16, torch.int64),
    ("larger", True, torch.float32, torch.int32), ("larger", False, torch.bfloat16, torch.int32),
    (None, False, torch.float32, torch.int64)])
def test_fused_residual_update_and_velocity_masking(sign, mean, value_dtype, index_dtype):
    sizes = [20000, 7, 3000]
    seg = Segments(sizes, [200, 7, 3], tile=2048)
    x = bucket(sizes, 11, "gauss")
    u = torch.randn(seg.n, device=DEV)
    a, b, (xa, xb), (ua, ub) = both(seg, x, sign=sign, mean=mean, update=True, velocity=u,
                                    value_dtype=value_dtype, index_dtype=index_dtype)
    assert_same(a, b)
    assert same(xa, xb) and same(ua, ub)
    assert b.positions.dtype == index_dtype and (mean or b.values.dtype == value_dtype)
    decode_add(seg, xb, b.positions, b.values, means=b.means, contract=TRITON)
    assert torch.allclose(xb, x, rtol=0, atol=1e-6), "what was sent plus what is kept is x"


@pytest.mark.parametrize("sign,mean,value_dtype", [("neg", True, torch.float32), (None, False, torch.float16)])
def test_the_update_in_the_write_pass_is_the_decode_of_the_own_message(sign, mean, value_dtype):
    """select(update=True, velocity=u) leaves x and u bit for bit as select, then the decode of
    the own message with alpha = -1 and the velocity masked (the exchange's memory update), do:
    the memory update can ride on the write pass (five launches instead of six)."""
    sizes = [3000, 5, 1200]
    seg = Segments(sizes, [30, 5, 12], tile=2048, align=16)
    gen = torch.Generator().manual_seed(12)
    x, u = (padded(seg, torch.randn(sum(sizes), generator=gen).to(DEV)) for _ in range(2))
    xa, ua, xb, ub = x.clone(), u.clone(), x.clone(), u.clone()
    a = select(seg, xa, TRITON, sign=sign, mean=mean, value_dtype=value_dtype)
    wire = {"means": a.means} if mean else {"values": a.values}
    decode_add(seg, xa, a.positions, alpha=-1.0, zero=ua, **wire, contract=TRITON)
    b = select(seg, xb, TRITON, sign=sign, mean=mean, value_dtype=value_dtype, update=True, velocity=ub)
    assert_same(a, b)
    assert same(xa, xb) and same(ua, ub)


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
def test_values_beyond_the_wire_type_travel_clamped_and_the_residual_keeps_the_rest(value_dtype):
    """A kept value beyond the wire type's largest finite number is written as that number
    (as ``core/wire.py:to_wire`` does), not inf, and x keeps the difference: equal to the
    reference bit for bit, every value and every residual finite."""
    sizes = [3000, 40]
    seg = Segments(sizes, [30, 4], tile=2048, align=16)
    x = padded(seg, torch.randn(sum(sizes), generator=torch.Generator().manual_seed(5)).to(DEV))
    x[7], x[3010] = 1e5, -3.4e38    # beyond fp16's 65504; beyond bf16's 3.39e38
    a, b, (xa, xb), _ = both(seg, x, update=True, value_dtype=value_dtype, index_dtype=torch.int32)
    assert_same(a, b)
    assert same(xa, xb)
    assert torch.isfinite(b.values).all() and torch.isfinite(xb).all()
    top = torch.finfo(value_dtype).max
    assert float(b.values.float().abs().max()) == top
    sent = float(b.values[int((b.positions[:30] == 7).nonzero())])
    assert float(xb[7]) == 1e5 - sent and sent == min(float(torch.tensor(1e5).to(value_dtype)), top)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_compensation_fused_with_the_first_histogram(grad_dtype, momentum, nesterov):
    sizes = [5000, 3, 9000]
    seg = Segments(sizes, [50, 3, 90], tile=4096)
    gen = torch.Generator().manual_seed(2)
    r, u = (torch.randn(seg.n, generator=gen).to(DEV) for _ in range(2))
    g = torch.randn(seg.n, generator=gen).to(DEV, grad_dtype)
    outs = {}
    for backend in ("torch", "triton"):
        x, u_new = torch.empty_like(r), torch.empty_like(r)
        hist = compensate(r, g, x, velocity=u if momentum else None, velocity_out=u_new if momentum else None,
                          momentum=momentum, nesterov=nesterov,
                          first=HistogramRequest(seg, "larger", Contract("radix", backend=backend)))
        outs[backend] = (x, u_new if momentum else None, hist)
    (xa, ua, ha), (xb, ub, hb) = outs["torch"], outs["triton"]
    assert same(xa, xb) and same(ua, ub) and torch.equal(ha, hb)
    if grad_dtype != torch.bfloat16 or not nesterov:
        return     # once: the selection from the fused histogram
    sa = select(seg, xa, TORCH, sign="larger", mean=True, first=ha)
    sb = select(seg, xb, TRITON, sign="larger", mean=True, first=hb)
    assert_same(sa, sb)


def test_sixty_layers_nonfinite_and_tiny_layers():
    gen = torch.Generator().manual_seed(60)
    sizes = [int(s) for s in torch.randint(1, 200, (60,), generator=gen)]
    sizes[5] = 5000
    ks = [max(1, n // 50) for n in sizes]
    ks[0], ks[1] = sizes[0], sizes[1] - 1
    seg = Segments(sizes, ks, tile=1024)
    x = bucket(sizes, 60, "gauss")
    x[seg.offsets[3] + 1] = float("nan")
    x[seg.offsets[40]] = -float("inf")
    for sign, mean in ((None, False), ("larger", True)):
        a, b, _, _ = both(seg, x, sign=sign, mean=mean)
        assert_same(a, b)
        assert b.nonfinite.nonzero().flatten().tolist() == [3, 40]


def workspace_is_clean(seg, R):
    """The histograms and arrival counters a call uses are zero again after it."""
    ws = triton_select.workspace(seg, R, DEV)
    return all(int(t.abs().sum()) == 0 for t in (ws.hist1, ws.hist2, ws.hist3, ws.arrivals))


@pytest.mark.parametrize("sign,mean", [(None, False), ("larger", True)])
def test_tiles_whose_candidates_overflow_their_buffer_are_read_again(sign, mean):
    """A layer of equal values (every element in the chosen bin) and one of zeros with k above
    its non-zeros overflow their tiles' candidate buffers; the stages read those tiles again,
    beside tiles that kept their candidates, and the result is the reference's."""
    sizes = [3000, 2048, 1500, 40]
    seg = Segments(sizes, [30, 5, 200, 40], tile=512, align=16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(sizes), generator=gen)
    x[3000:5048] = -0.5                                             # ties: all in one bin
    x[5048:6548] = torch.where(torch.rand(1500, generator=gen) < 0.9, 0.0, x[5048:6548])   # T = 0
    x, u = padded(seg, x.to(DEV)), padded(seg, torch.randn(sum(sizes), generator=gen).to(DEV))
    R = 1 if sign is None else 2
    a, b, (xa, xb), (ua, ub) = both(seg, x, sign=sign, mean=mean, update=True, velocity=u)
    assert_same(a, b)
    assert same(xa, xb) and same(ua, ub)
    ws = triton_select.workspace(seg, R, DEV)
    caps = (ws.cand_lo[1:] - ws.cand_lo[:-1]).cpu()
    spilled = ws.cand_n.cpu() > caps
    assert spilled.any() and (~spilled).any(), (ws.cand_n, caps)
    assert workspace_is_clean(seg, R)


def test_padding_is_never_selected_and_stays_zero():
    """With align=16 the gaps between layers are never read as data: NaN there raises no flag
    and changes nothing; the compensation writes zeros there."""
    sizes = [1000, 3, 777, 1]
    seg = Segments(sizes, [10, 3, 7, 1], tile=256, align=16)
    gen = torch.Generator().manual_seed(9)
    r, g, u = (torch.randn(sum(sizes), generator=gen).to(DEV) for _ in range(3))
    pad = torch.ones(seg.n, dtype=torch.bool, device=DEV)
    for view in seg.views(pad):
        view.fill_(False)
    outs = {}
    for backend in ("torch", "triton"):
        x, u_new = torch.full((seg.n,), float("nan"), device=DEV), torch.full((seg.n,), float("nan"), device=DEV)
        c = Contract("radix", backend=backend)
        hist = compensate(padded(seg, r, float("nan")), padded(seg, g, float("nan")), x,
                          velocity=padded(seg, u, float("nan")), velocity_out=u_new, momentum=0.9,
                          first=HistogramRequest(seg, "pos", c))
        assert (x[pad] == 0).all() and (u_new[pad] == 0).all(), backend
        sel = select(seg, x, c, sign="pos", mean=True, first=hist, update=True, velocity=u_new)
        assert not sel.nonfinite.any()
        outs[backend] = (sel, x, u_new)
    (a, xa, ua), (b, xb, ub) = outs["torch"], outs["triton"]
    assert_same(a, b)
    assert same(xa, xb) and same(ua, ub) and (xb[pad] == 0).all()
    x = padded(seg, r, float("nan"))             # a select alone reads no padding either
    a, b, _, _ = both(seg, x, sign=None)
    assert_same(a, b) and not b.nonfinite.any()


def test_a_histogram_nobody_consumed_is_not_added_to():
    """compensate's histogram is the layout's workspace, which select leaves zeroed; a second
    compensate before any select starts from zero again, and a select given another histogram
    uses that one."""
    sizes = [3000, 500]
    seg = Segments(sizes, [30, 5], tile=1024, align=16)
    gen = torch.Generator().manual_seed(4)
    r, g = (torch.randn(seg.n, generator=gen).to(DEV) for _ in range(2))
    x_ref = torch.empty_like(r)
    h_ref = compensate(r, g, x_ref, first=HistogramRequest(seg, None, TORCH))
    want = select(seg, x_ref.clone(), TORCH, first=h_ref)
    x = torch.empty_like(r)
    compensate(g, r, x, first=HistogramRequest(seg, None, TRITON))               # never consumed
    hist = compensate(r, g, x, first=HistogramRequest(seg, None, TRITON))
    assert torch.equal(hist, h_ref)
    assert_same(want, select(seg, x.clone(), TRITON, first=hist))
    assert workspace_is_clean(seg, 1)
    compensate(g, r, x.clone(), first=HistogramRequest(seg, None, TRITON))       # never consumed again
    assert_same(want, select(seg, x, TRITON, first=h_ref))
    assert workspace_is_clean(seg, 1)


def model_bucket(model, options, scale):
    """A bucket shaped like a model's compressed layers (those of at least 4096 elements, in
    order, k = ceil(0.001 n)), each layer's size divided by ``scale`` (launches do not depend on
    sizes; the interpreter's time does)."""
    import math

    from redsync_hvd.models import build_model
    with torch.device("meta"):           # the shapes only
        net = build_model(model, 10, (3, 32, 32), **options)
    sizes = [max(1, p.numel() // scale) for p in net.parameters() if p.numel() >= 4096]
    return Segments(sizes, [math.ceil(0.001 * n) for n in sizes], align=16)


@pytest.mark.parametrize("model,options,scale", [("resnet20", {}, 16),
                                                 ("vgg", {"fc_width": 4096, "width": 0.25}, 4096)])
def test_five_launches_per_bucket_whatever_its_layers(model, options, scale):
    """compensate (DGC momentum) + select with sign_mean, the residual update and the velocity
    masking, as a step of the exchange runs them: five Triton launches and no other kernel
    (no fill, no copy, no cast), counted with core/launches.py once the layout's tables and
    workspace exist (built once per layout)."""
    from redsync_hvd.core.launches import Launches
    seg = model_bucket(model, options, scale)
    gen = torch.Generator().manual_seed(0)
    r, u, g = (torch.randn(seg.n, generator=gen).to(DEV) for _ in range(3))
    x, u_new = torch.zeros_like(r), torch.zeros_like(r)
    seg.tables(DEV), k_rows(seg, DEV, "pos"), triton_select.workspace(seg, 2, DEV)
    with Launches() as launches:
        hist = compensate(r, g, x, velocity=u, velocity_out=u_new, momentum=0.9,
                          first=HistogramRequest(seg, "pos", TRITON))
        sel = select(seg, x, TRITON, sign="pos", mean=True, first=hist, update=True, velocity=u_new)
    assert launches.triton == ["_pass1", "_filter", "_refine", "_count", "_write"], launches.triton
    assert launches.aten == [], launches.aten
    with Launches() as launches:        # the count can fail: it sees other kernels
        decode_add(seg, x, sel.positions, means=sel.means, contract=TRITON)
        x.zero_()
    assert launches.triton == ["_decode"] and launches.aten == ["aten::zero_"], (launches.triton, launches.aten)


def test_decode_of_gathered_messages_is_the_reference_in_rank_order():
    sizes = [6000, 5, 2500]
    seg = Segments(sizes, [60, 5, 25], tile=1024)
    gen = torch.Generator().manual_seed(4)
    msgs = [select(seg, torch.randn(seg.n, generator=gen).to(DEV), TORCH, sign="pos", mean=True)
            for _ in range(3)]
    pos = torch.stack([m.positions for m in msgs])
    means = torch.stack([m.means for m in msgs])
    vals = torch.randn(pos.shape, generator=gen).to(DEV, torch.float16)
    for wire in ({"values": vals}, {"means": means}):
        base = torch.randn(seg.n, generator=gen).to(DEV)
        outs = [base.clone(), base.clone()]
        zeros = [torch.ones_like(base), torch.ones_like(base)]
        for out, zero, backend in zip(outs, zeros, ("torch", "triton")):
            decode_add(seg, out, pos, alpha=1 / 3, zero=zero, **wire, contract=Contract("radix", backend=backend))
        assert same(outs[0], outs[1]) and same(zeros[0], zeros[1])


def test_triton_needs_the_interpreter_or_cuda(monkeypatch):
    if CUDA:
        pytest.skip("CUDA present: the compiled kernels run")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    seg = Segments([10], [1])
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 before triton is imported, or pass CUDA tensors"):
        select(seg, torch.zeros(10), TRITON)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: torch.cuda's sync check sees real device waits")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_device_sync_in_a_compressed_step(backend):
    """With torch.cuda.set_sync_debug_mode("error") any op that waits for the GPU raises:
    a whole step (compensate with DGC momentum, select with the fused update, decode of 4
    ranks' messages) runs without one. The first call, outside, builds the tables and compiles."""
    sizes = [1 << 20, 4096, 3, 250000]
    seg = Segments(sizes, [n // 1000 + 1 for n in sizes])
    r, u, g = (torch.randn(seg.n, device=DEV) for _ in range(3))
    x, u_new, avg = torch.empty_like(r), torch.empty_like(r), torch.zeros_like(r)

    c = Contract("radix", backend=backend)

    def step():
        hist = compensate(r, g.half(), x, velocity=u, velocity_out=u_new, momentum=0.9,
                          first=HistogramRequest(seg, "larger", c))
        sel = select(seg, x, c, sign="larger", mean=True, first=hist, update=True, velocity=u_new)
        decode_add(seg, avg, torch.stack([sel.positions] * 4), means=torch.stack([sel.means] * 4),
                   alpha=0.25, contract=c)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def _exchange_steps(backend, quantize, steps=3):
    """Three steps of a radix exchange (DGC momentum, a dense layer beside; the last one runs kernel
    variants compiled before, as the sign alternates): each step's averages,
    the residuals, and the host reads and (CUDA) device syncs of the last step."""
    import warnings

    from redsync_hvd.comm import LocalCommunicator
    from redsync_hvd.compressors.base import Layer
    from redsync_hvd.core.host_reads import HostReads
    from redsync_hvd.engine import MomentumSpec, build_exchange
    sizes = [3000, 1200, 40]
    layers = [Layer(f"l{i}", (n,), n, i, torch.device(DEV)) for i, n in enumerate(sizes)]
    spec = {"method": "redsync", "density": 0.01, "message": {"quantize": quantize},
            "selection": {"method": "radix", "radix_backend": backend}, "policy": {"min_compress_numel": 100}}
    mom = MomentumSpec(dict.fromkeys((l.name for l in layers), 0.9))
    ex = build_exchange(spec, layers, LocalCommunicator(2), take_momentum=lambda: mom, agree=False).exchange
    gen = torch.Generator().manual_seed(5)
    outs = []
    for step in range(steps):
        grads = {l.name: torch.randn(l.numel, generator=gen).half().to(DEV) for l in layers}
        last = step == steps - 1
        with HostReads() as reads, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if CUDA and last:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                for l in reversed(layers):
                    ex.submit(l.name, grads[l.name])
                outs.append({n: t.clone() for n, t in ex.finish().averages.items()})
            finally:
                if CUDA:
                    torch.cuda.set_sync_debug_mode(0)
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]
    return outs, ex.residuals(), reads.events, syncs


@pytest.mark.parametrize("quantize", ["none", "sign_mean"])
def test_exchange_with_the_kernels_equals_the_reference(quantize):
    """The exchange's radix stage on the Triton kernels (compensate with fp16 gradients and DGC
    momentum, select, the memory update, the decode of the gathered bucket) gives the torch
    reference's averages and residuals, bit for bit with values (sign_mean: the means to the
    last float32 bit); the step's only host read is the finite agreement in finish(), and on
    CUDA it is the step's only device sync."""
    ref, ref_r, _, _ = _exchange_steps("torch", quantize)
    got, got_r, reads, syncs = _exchange_steps("triton", quantize)
    for a, b in zip(ref, got):
        for n in a:
            assert same(a[n], b[n]) if quantize == "none" else torch.allclose(a[n], b[n], rtol=1e-6, atol=0), n
    for n in ref_r:
        assert same(ref_r[n], got_r[n]) if quantize == "none" else torch.allclose(ref_r[n], got_r[n], rtol=1e-5,
                                                                                  atol=1e-7), n
    assert reads == [("tolist", "redsync_hvd.exchange.exchange:_read")], reads
    if CUDA:    # where each sync was asked for: the finite check's read alone
        assert len(syncs) == 1, syncs


def test_every_kernel_compiles_for_sm90_without_spills():
    """The interpreter accepts code the compiler rejects: compile the widest variant of each
    kernel for an H100/H200 (no GPU needed) in a fresh process, where the kernels are not
    decorated for the interpreter. With layers aligned to 16 elements the streaming passes
    load 128 bits at a time."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = subprocess.run([sys.executable, os.path.join(root, "scripts", "compile_kernels.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=root)
    if got.returncode == 2:
        pytest.skip(got.stdout.strip())
    assert got.returncode == 0, got.stdout + got.stderr[-2000:]
    wide = {line.split()[1]: int(line.rsplit(" ", 1)[1]) for line in got.stdout.splitlines() if "128-bit" in line}
    assert wide["_pass1"] >= 4 and wide["_filter"] >= 4, got.stdout
