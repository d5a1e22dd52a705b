"""Our own rounding never poisons the state (redsync_hvd/core/wire.py).

A cast to a narrower type rounds a value beyond its finite range (fp16: 65504) to inf: sent
as it is, the average would be inf and the residual x - inf = -inf for good. Each lossy wire
type is driven here through the real exchange (one process, ``LocalCommunicator``) with
one element of 1e5 at step 0, and with extreme but finite gradients (hypothesis): the
averages and residuals stay finite, and what was sent plus the new residual is what was
there to send (error feedback keeps what the wire could not carry).
"""
import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.compressors.base import Layer
from redsync_hvd.core.segments import Segments
from redsync_hvd.core.select import Contract, select
from redsync_hvd.core.wire import finite_evidence, to_wire, wide_mean, wide_norm, wire_limit
from redsync_hvd.engine import build_exchange

FLT_MAX = torch.finfo(torch.float32).max
STATIC = {"policy": {"min_compress_numel": 100}}
# every wire that rounds or summarises: method spec, and whether the layer must be a matrix
WIRES = {
    "radix-fp16": {"method": "redsync", "selection": "radix", "message": {"quantize": "fp16"}},
    "radix-sign_mean": {"method": "redsync", "selection": "radix", "message": {"quantize": "sign_mean"}},
    "radix-fp32": {"method": "redsync", "selection": "radix", "message": {"quantize": "none"}},
    "tbs-fp16": {"method": "redsync", "selection": "tbs", "message": {"quantize": "fp16"}},
    "tbs-sign_mean": {"method": "redsync", "selection": "tbs", "message": {"quantize": "sign_mean"}},
    "bucket-fp16": {"method": "redsync", "selection": {"method": "tbs", "scope": "bucket"},
                    "message": {"quantize": "fp16"}},
    "bucket-sign_mean": {"method": "redsync", "selection": {"method": "tbs", "scope": "bucket"},
                         "message": {"quantize": "sign_mean"}},
    "exact-fp16": {"method": "redsync", "selection": "exact", "message": {"quantize": "fp16"}},
    "sbc": {"method": "sbc"},
    "fp16-dense": {"method": "fp16"},
    "signsgd": {"method": "signsgd"},
    "qsgd": {"method": "qsgd", "residual": True},
    "powersgd": {"method": "powersgd", "rank": 2},
}
DENSITY_METHODS = ("redsync", "sbc")


def exchange_for(wire: str, shape=(50, 100), world: int = 2):
    spec = {**WIRES[wire]}
    if spec["method"] in DENSITY_METHODS:
        spec.update({"density": 0.01, "dgc": {"momentum_correction": False}, **STATIC})
    if spec["method"] == "sbc":
        spec.pop("dgc")
    numel = math.prod(shape)
    layer = Layer("w", shape, numel, 0)
    return build_exchange(spec, [layer], LocalCommunicator(world), agree=False).exchange, layer


def residual(ex) -> torch.Tensor:
    return ex.state_dict()["memory"].get("residual", {}).get("w", torch.zeros(0))


def step(ex, grad: torch.Tensor) -> torch.Tensor:
    ex.submit("w", grad.clone())
    return ex.finish().averages["w"].clone()


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_one_huge_element_at_step_0_stays_finite_on_every_wire(wire):
    """One layer of 5000 elements, density 0.01, one value of 1e5 (beyond fp16's
    65504) at step 0, then ordinary steps. Every average is finite, the residual stays finite, no
    step raises; on fp16 wires the value sent is the largest the wire holds (65504, or 65504/2
    for the dense allreduce of 2 workers, which sums in fp16) and the residual keeps the rest."""
    ex, layer = exchange_for(wire)
    gen = torch.Generator().manual_seed(0)
    for s in range(4):
        g = torch.randn(layer.numel, generator=gen) * 0.01
        if s == 0:
            g[1234] = 1e5
        avg = step(ex, g)
        r = residual(ex)
        assert torch.isfinite(avg).all(), (wire, s, avg[~torch.isfinite(avg)])
        assert torch.isfinite(r).all(), (wire, s)
        if s == 0 and "fp16" in wire:
            sent = avg[1234].item()
            assert sent == (65504.0 / 2 if wire == "fp16-dense" else 65504.0), sent
            if wire != "fp16-dense":   # no residual there
                assert r[1234].item() == 1e5 - 65504.0


def test_the_tbs_path_no_longer_fails_later_steps():
    """The tbs path selects per layer and raises NonFiniteError on a non-finite residual, which
    the exchange cannot recover from (the residual alone is compressed again): ten steps run,
    and the residual drains the rest of the 1e5 at 65504 per send."""
    ex, layer = exchange_for("tbs-fp16", shape=(5000,))
    gen = torch.Generator().manual_seed(1)
    for s in range(10):
        g = torch.randn(layer.numel, generator=gen) * 0.01
        if s == 0:
            g[7] = 1e5
        step(ex, g)
    assert torch.isfinite(residual(ex)).all() and abs(residual(ex)[7].item()) < 1


# -- to_wire and its companions ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_to_wire_clamps_finite_values_and_keeps_nan(dtype):
    top = torch.finfo(dtype).max
    source = torch.float64 if dtype == torch.float32 else torch.float32
    x = torch.tensor([1e5, -1e5, 3.4e38, -3.4e38, 1.5, math.inf, -math.inf, math.nan], dtype=source)
    w = to_wire(x, dtype)
    assert w.dtype == dtype
    assert torch.isfinite(w[:7]).all() and torch.isnan(w[7])
    assert w[5].item() == top and w[6].item() == -top
    if dtype != torch.float32:
        assert w[4].item() == 1.5
    plain = x.to(dtype)
    finite_in_range = x.abs() <= top
    assert torch.equal(w[finite_in_range], plain[finite_in_range])    # nothing else changes


def test_wire_limit_of_a_sum_stays_finite_at_every_partial_sum():
    for workers in (1, 2, 3, 7, 64):
        limit = wire_limit(torch.float16, workers)
        assert limit * workers <= 65504 and torch.tensor(limit, dtype=torch.float16).item() == limit
        total = torch.zeros((), dtype=torch.float16)
        for _ in range(workers):
            total = total + torch.tensor(limit, dtype=torch.float16)
            assert torch.isfinite(total)
    assert to_wire(torch.ones(3), torch.float32) is not None and wire_limit(torch.float32) == FLT_MAX


def test_wide_figures_are_the_fp32_ones_where_finite_and_finite_where_those_overflow():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(wide_mean(x), x.mean()) and torch.equal(wide_norm(x.view(10, 100), 1),
                                                               torch.linalg.vector_norm(x.view(10, 100), dim=1))
    huge = torch.full((100,), 3e38)
    assert torch.isinf(huge.mean()) and wide_mean(huge).item() == pytest.approx(3e38, rel=1e-6)
    big = torch.full((4, 25), 1e20)
    assert torch.isinf(torch.linalg.vector_norm(big, dim=1)).all()
    assert torch.allclose(wide_norm(big, 1), torch.full((4,), 5e20))
    assert wide_norm(torch.full((1, 100), 3e38), 1).item() == FLT_MAX   # the norm itself is beyond fp32
    assert torch.isfinite(finite_evidence(huge)) and not torch.isfinite(finite_evidence(torch.tensor([1.0, -math.inf])))
    assert torch.isnan(finite_evidence(torch.tensor([1.0, math.nan, 2.0])))


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(st.floats(width=32), st.sampled_from([math.inf, -math.inf, math.nan, -0.0])),
                       max_size=40),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_finite_evidence_is_the_largest_magnitude_as_the_inf_norm_gives_it(values, dtype):
    """The CPU's one aminmax pass gives the inf-norm's number (its dtype, its NaN, its inf; 0 for
    nothing); the local steps' check names exactly the layers that hold NaN or Inf, and leaves
    every gradient's values as they were (a NaN stays a NaN)."""
    from redsync_hvd.torch.delayed import nonfinite_grads
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    got = finite_evidence(x)
    want = torch.linalg.vector_norm(x, ord=math.inf) if values else x.new_zeros(())
    assert got.dtype == want.dtype and got.shape == want.shape == ()
    assert torch.equal(got, want) or (torch.isnan(got) and torch.isnan(want)), (values, got, want)
    params = {name: torch.nn.Parameter(torch.zeros(t.shape, dtype=t.dtype)) for name, t in
              (("x", x), ("ok", torch.ones(3, dtype=dtype)), ("ok32", torch.ones(2)))}
    for name, t in (("x", x), ("ok", torch.ones(3, dtype=dtype)), ("ok32", torch.ones(2))):
        params[name].grad = t.clone()
    assert nonfinite_grads(params) == ([] if bool(torch.isfinite(got)) else ["x"])
    torch.testing.assert_close(params["x"].grad, x, rtol=0, atol=0, equal_nan=True)   # NaN stays NaN


@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
def test_the_radix_reference_sends_the_clamped_value_and_keeps_the_rest(value_dtype):
    """The exact-k torch reference (the Triton kernel's twin, compared bit for bit in
    test_triton_select.py): values beyond the wire's range go out as its largest finite value
    and, with update=True, x keeps x - that value."""
    seg = Segments([64], [4])
    x = torch.zeros(64)
    x[[3, 9, 20, 40]] = torch.tensor([1e5, -2e5, 3.4e38, -3.4e38])
    before = x.clone()
    sel = select(seg, x, Contract("radix", backend="torch"), value_dtype=value_dtype, update=True)
    top = torch.finfo(value_dtype).max
    sent = sel.values.float()
    assert torch.isfinite(sent).all() and torch.isfinite(x).all()
    expect = to_wire(before[sel.positions.long()], value_dtype).float()
    assert torch.equal(sent, expect) and sent.abs().max().item() <= top
    assert torch.equal(x[sel.positions.long()], before[sel.positions.long()] - sent)


# -- extreme but finite gradients: finite residual, conservation ----------------------------------
def _extreme(draw_scale: float):
    values = st.floats(min_value=-draw_scale, max_value=draw_scale, allow_nan=False, allow_infinity=False,
                       width=32)
    return st.lists(values, min_size=128, max_size=128)


LOSSY = ("radix-fp16", "radix-sign_mean", "tbs-fp16", "tbs-sign_mean", "bucket-fp16", "bucket-sign_mean",
         "exact-fp16", "sbc", "signsgd", "qsgd")


@pytest.mark.parametrize("wire", LOSSY)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=_extreme(FLT_MAX / 2), second=_extreme(FLT_MAX / 2))
def test_extreme_finite_gradients_keep_a_finite_residual_and_lose_nothing(wire, first, second):
    """Two steps on one worker with gradients anywhere in [-FLT_MAX/2, FLT_MAX/2] (so r + g
    cannot overflow fp32 itself): no step fails, the averages and the residual are finite, and
    per element the new residual is x - sent (x = old residual + gradient) bit for bit. So
    sent + residual == x up to the rounding of that one fp32 subtraction (at most half an ulp
    of the residual), and exactly on the fp16 wires wherever the value sent is x rounded or
    |x| <= 2 * 65504 (Sterbenz: the subtraction of a clamped value is exact there)."""
    ex, layer = exchange_for(wire, shape=(128,), world=1)
    assert layer.compressed
    for grad in (torch.tensor(first), torch.tensor(second)):
        x = residual(ex) + grad if residual(ex).numel() else grad.clone()
        sent = step(ex, grad)
        r = residual(ex)
        assert torch.isfinite(sent).all() and torch.isfinite(r).all(), wire
        assert torch.equal(r, x - sent), wire
        error = (sent.double() + r.double() - x.double()).abs()
        assert (error <= 0.5 * torch.finfo(torch.float32).eps * r.double().abs()).all(), wire
        if wire.endswith("fp16"):
            assert (error[x.abs() <= 2 * 65504] == 0).all(), wire


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(min_value=-FLT_MAX / 64, max_value=FLT_MAX / 64, allow_nan=False, width=32),
                       min_size=256, max_size=256))
def test_powersgd_with_extreme_finite_gradients_keeps_a_finite_residual(values):
    """PowerSGD sends fp32 factors (no lossy cast); its Gram-Schmidt norm is the one sum that
    overflowed early (squares past 1.8e19), now recomputed in float64 where fp32 gives inf.
    Up to FLT_MAX / (4 sqrt(columns)) (a row norm within fp32) the residual stays finite: a
    16 x 16 layer, values up to FLT_MAX / 64."""
    ex, layer = exchange_for("powersgd", shape=(16, 16), world=1)
    g = torch.tensor(values)
    sent = step(ex, g)
    r = residual(ex)
    assert torch.isfinite(sent).all() and torch.isfinite(r).all()
    assert torch.equal(r, g - sent)


def test_the_local_steps_check_reads_a_sparse_gradient_by_its_values():
    """An Embedding(sparse=True) under local steps steps on a sparse gradient: the check names it
    when a looked-up row holds NaN, and passes it otherwise (neither fused op takes sparse tensors)."""
    from redsync_hvd.torch.delayed import nonfinite_grads
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad.is_sparse and nonfinite_grads(dict(emb.named_parameters())) == []
    emb.weight.grad = torch.sparse_coo_tensor([[3]], torch.tensor([[1.0, math.nan, 0.0, 0.0]]), (10, 4),
                                             check_invariants=True)
    assert nonfinite_grads(dict(emb.named_parameters())) == ["weight"]
