"""The Triton kernels (core/triton_select.py) against the torch reference, bit for bit.

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

from redsync_hvd.core import radix_select as rs  # noqa: E402
from redsync_hvd.core.segments import Segments  # noqa: E402

try:
    import triton  # noqa: F401

    from redsync_hvd.core import triton_select  # noqa: F401
    _WHY = ""
except ImportError as e:     # pragma: no cover - CI installs the 'kernels' extra
    _WHY = f"triton cannot be imported ({e}); install it: pip install -e .[kernels]"
pytestmark = pytest.mark.skipif(bool(_WHY), reason=_WHY or "triton present")

DEV = "cuda" if CUDA else "cpu"
FIELDS = ("positions", "values", "nonfinite", "kth", "side")


def bucket(sizes, seed, kind):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), generator=gen)
    if kind == "ties":
        x = torch.round(x * 2) / 2
    elif kind == "heavy":
        x = x ** 3
    return x.to(DEV)


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
    a = rs.select(seg, xa, backend="torch", velocity=ua, **kw)
    b = rs.select(seg, xb, backend="triton", velocity=ub, **kw)
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
       sign=st.sampled_from(rs.SIGNS), tile=st.sampled_from([512, 1024]))
@example(sizes=[2500, 3, 1800], fracs=[0.01, 1.0, 0.3], seed=1, kind="ties", sign="larger", tile=512)
@example(sizes=[2400, 1], fracs=[0.99, 1.0], seed=2, kind="heavy", sign="neg", tile=512)
def test_triton_equals_the_reference(sizes, fracs, seed, kind, sign, tile):
    seg = Segments(sizes, [round(f * n) for f, n in zip(fracs, sizes)], tile=tile)
    x = bucket(sizes, seed, kind)
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
    rs.decode_add(seg, xb, b.positions, b.values, means=b.means, backend="triton")
    assert torch.allclose(xb, x, rtol=0, atol=1e-6), "what was sent plus what is kept is x"


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
        hist = rs.compensate(seg, r, g, x, velocity=u if momentum else None, velocity_out=u_new if momentum else None,
                             momentum=momentum, nesterov=nesterov, sign="larger", backend=backend)
        outs[backend] = (x, u_new if momentum else None, hist)
    (xa, ua, ha), (xb, ub, hb) = outs["torch"], outs["triton"]
    assert same(xa, xb) and same(ua, ub) and torch.equal(ha, hb)
    if grad_dtype != torch.bfloat16 or not nesterov:
        return     # once: the selection from the fused histogram
    sa = rs.select(seg, xa, sign="larger", mean=True, hist=ha, backend="torch")
    sb = rs.select(seg, xb, sign="larger", mean=True, hist=hb, backend="triton")
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


def test_decode_of_gathered_messages_is_the_reference_in_rank_order():
    sizes = [6000, 5, 2500]
    seg = Segments(sizes, [60, 5, 25], tile=1024)
    gen = torch.Generator().manual_seed(4)
    msgs = [rs.select(seg, torch.randn(seg.n, generator=gen).to(DEV), sign="pos", mean=True, backend="torch")
            for _ in range(3)]
    pos = torch.stack([m.positions for m in msgs])
    means = torch.stack([m.means for m in msgs])
    vals = torch.randn(pos.shape, generator=gen).to(DEV, torch.float16)
    for wire in ({"values": vals}, {"means": means}):
        base = torch.randn(seg.n, generator=gen).to(DEV)
        outs = [base.clone(), base.clone()]
        zeros = [torch.ones_like(base), torch.ones_like(base)]
        for out, zero, backend in zip(outs, zeros, ("torch", "triton")):
            rs.decode_add(seg, out, pos, alpha=1 / 3, zero=zero, backend=backend, **wire)
        assert same(outs[0], outs[1]) and same(zeros[0], zeros[1])


def test_triton_needs_the_interpreter_or_cuda(monkeypatch):
    if CUDA:
        pytest.skip("CUDA present: the compiled kernels run")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    seg = Segments([10], [1])
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1 before triton is imported, or pass CUDA tensors"):
        rs.select(seg, torch.zeros(10), backend="triton")


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

    def step():
        hist = rs.compensate(seg, r, g.half(), x, velocity=u, velocity_out=u_new, momentum=0.9, sign="larger",
                             backend=backend)
        sel = rs.select(seg, x, sign="larger", mean=True, hist=hist, update=True, velocity=u_new, backend=backend)
        rs.decode_add(seg, avg, torch.stack([sel.positions] * 4), means=torch.stack([sel.means] * 4),
                      alpha=0.25, backend=backend)
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
        syncs = sum("synchronizing" in str(w.message) for w in caught)
    return outs, dict(ex.memory.residual), reads.events, syncs


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
    assert reads == [("tolist", "redsync_hvd.exchange.pipeline:_read")], reads
    if CUDA:
        assert syncs == 1, syncs


def test_every_kernel_compiles_for_sm90_without_spills():
    """The interpreter accepts code the compiler rejects: compile the widest variant of each
    kernel for an H100/H200 (no GPU needed) in a fresh process, where the kernels are not
    decorated for the interpreter."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = subprocess.run([sys.executable, os.path.join(root, "scripts", "compile_kernels.py"), "--quick"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=root)
    if got.returncode == 2:
        pytest.skip(got.stdout.strip())
    assert got.returncode == 0, got.stdout + got.stderr[-2000:]
