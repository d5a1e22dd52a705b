"""The incumbent baselines' math: QSGD, EF-signSGD, PowerSGD, and PowerSGD against torch's hook."""
import math

import pytest
import torch
from launch import run_torch_script
from pydantic import ValidationError

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.compressors.base import Layer
from redsync_hvd.compressors.powersgd import PowerSGDCompressor, PowerSGDConfig, gram_schmidt, orthogonalize
from redsync_hvd.compressors.qsgd import QSGDCompressor, QSGDConfig, levels, rounding_seed
from redsync_hvd.compressors.signsgd import SignSGDCompressor, SignSGDConfig
from redsync_hvd.config.registry import METHODS as COMPRESSORS
from redsync_hvd.core import bitpack


def layer(shape, index=0, name="w"):
    return Layer(name, tuple(shape), math.prod(shape), index)


# -- packing ---------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_bitpack_round_trip(bits, n):
    codes = torch.randint(0, 2 ** bits, (n,), generator=torch.Generator().manual_seed(n))
    packed = bitpack.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(bitpack.unpack(packed, bits, n), codes.to(torch.uint8))
    with pytest.raises(ValueError, match="bytes cannot hold"):
        bitpack.unpack(packed, bits, n + 8 // bits * 2)


# -- EF-signSGD --------------------------------------------------------------------------
def test_signsgd_sends_the_l1_scaled_sign_in_one_bit_per_element():
    x = torch.tensor([0.5, -2.0, 0.0, 1.5, -0.25, 3.0, -1.0, 0.75, -4.0, 2.0, 0.0])
    comp = SignSGDCompressor(SignSGDConfig())
    msg = comp.compress(x, layer(x.shape), 0)
    packed, scale = msg.tensors
    assert scale.item() == pytest.approx(x.abs().sum().item() / x.numel())     # ||x||_1 / d
    assert packed.dtype == torch.uint8 and packed.numel() == 2                  # 11 bits -> 2 bytes
    assert msg.nbytes() == {"values": 2, "scalars": 4}
    assert torch.equal(bitpack.unpack(packed, 1, x.numel()), (x >= 0).to(torch.uint8))
    out = torch.zeros_like(x)
    comp.decompress_add(out, msg.tensors, layer(x.shape), alpha=2.0)
    expect = 2 * scale * torch.where(x >= 0, 1.0, -1.0)                         # sign(0) -> +1
    assert torch.allclose(out, expect)


def test_signsgd_error_feedback_keeps_what_the_sign_missed():
    comp, lay = SignSGDCompressor(SignSGDConfig()), layer((300,))
    gen = torch.Generator().manual_seed(3)
    residual, total_in, total_out = torch.zeros(300), torch.zeros(300), torch.zeros(300)
    for step in range(20):
        g = torch.randn(300, generator=gen)
        x = residual + g
        msg = comp.compress(x, lay, step)
        sent = torch.zeros(300)
        comp.decompress_add(sent, msg.tensors, lay)
        residual = x - sent                        # e_{t+1} = p_t - Delta_t
        total_in += g
        total_out += sent
    assert torch.allclose(total_out + residual, total_in, atol=1e-4)


def test_signsgd_config_refuses_unknown_keys():
    with pytest.raises(ValidationError, match="extra"):
        SignSGDConfig(density=0.1)


# -- QSGD ------------------------------------------------------------------------------
def _paper_outcomes(v: torch.Tensor, s: int, bucket: int):
    """The quantiser's two outcomes and the probability of the upper one, from section 3.1."""
    pad = (-v.numel()) % bucket
    b = torch.cat([v, v.new_zeros(pad)]).view(-1, bucket).double()
    norm = b.norm(dim=1, keepdim=True)
    ratio = torch.where(norm > 0, b.abs() / norm, torch.zeros_like(b)) * s
    low = ratio.floor()
    p = ratio - low
    scale = norm * torch.sign(b) / s
    cut = slice(0, v.numel())
    return (scale * low).reshape(-1)[cut], (scale * (low + 1)).reshape(-1)[cut], p.reshape(-1)[cut]


def _draws(comp, v, count):
    lay = layer(v.shape)
    outs = []
    for step in range(count):
        out = torch.zeros_like(v)
        comp.decompress_add(out, comp.compress(v, lay, step).tensors, lay)
        outs.append(out.double())
    return torch.stack(outs)


@pytest.mark.parametrize("bits, bucket", [(2, 16), (4, 512), (8, 64)])
def test_qsgd_is_unbiased(bits, bucket):
    v = torch.randn(200, generator=torch.Generator().manual_seed(bits)) * torch.linspace(0.01, 3, 200)
    comp, s = QSGDCompressor(QSGDConfig(bits=bits, bucket_size=bucket)), levels(bits)
    low, high, p = _paper_outcomes(v, s, bucket)
    # the exact expectation: (1 - p) * low + p * high == v for every element
    assert torch.allclose((1 - p) * low + p * high, v.double(), atol=1e-6)
    draws = _draws(comp, v, 3000)
    tol = 1e-5 * (1 + high.abs())
    assert bool((((draws - low).abs() <= tol) | ((draws - high).abs() <= tol)).all()), "not one of two outcomes"
    # the sample mean is within 5 standard errors of v (each draw has variance (high-low)^2 p(1-p))
    stderr = ((high - low).abs() * (p * (1 - p)).sqrt() / math.sqrt(len(draws))).clamp(min=1e-7)
    z = (draws.mean(0) - v.double()).abs() / stderr
    assert z.max() < 5, f"max z-score {z.max():.1f}"


def test_qsgd_variance_is_within_the_papers_bound():
    d, s = 256, levels(4)
    v = torch.randn(d, generator=torch.Generator().manual_seed(7))
    draws = _draws(QSGDCompressor(QSGDConfig(bits=4, bucket_size=d)), v, 500)
    variance = (draws - v.double()).square().sum(1).mean().item()
    bound = min(d / s ** 2, math.sqrt(d) / s) * v.double().square().sum().item()
    assert 0 < variance <= bound, (variance, bound)


def test_qsgd_message_bytes_seeds_and_zero_buckets():
    v = torch.cat([torch.zeros(64), torch.randn(100, generator=torch.Generator().manual_seed(1))])
    lay = layer(v.shape, index=3)
    comp = QSGDCompressor(QSGDConfig(bits=4, bucket_size=64))
    msg = comp.compress(v, lay, 5)
    assert msg.nbytes() == {"scalars": 4 * 3, "values": math.ceil(164 * 4 / 8)}
    out = torch.zeros_like(v)
    comp.decompress_add(out, msg.tensors, lay)
    assert torch.equal(out[:64], torch.zeros(64))          # an all-zero bucket stays zero, no NaN
    again = comp.compress(v, lay, 5)
    assert all(torch.equal(a, b) for a, b in zip(msg.tensors, again.tensors)), "same seed, different draw"
    assert not torch.equal(comp.compress(v, lay, 6).tensors[1], msg.tensors[1]), "steps share noise"
    seeds = {rounding_seed(0, r, t, i) for r in range(4) for t in range(50) for i in range(20)}
    assert len(seeds) == 4 * 50 * 20, "two (rank, step, layer) draw the same noise"


# -- PowerSGD --------------------------------------------------------------------------
@pytest.mark.parametrize("method, rank", [("gram_schmidt", 1), ("gram_schmidt", 2), ("auto", 2),
                                          ("qr", 3), ("auto", 4)])
def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space(method, rank):
    m = torch.randn(40, rank, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    q = orthogonalize(m.clone(), method)
    assert torch.allclose(q.t() @ q, torch.eye(rank, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(q @ (q.t() @ m), m, atol=1e-10)        # m lies in span(q)


def test_orthogonalize_keeps_a_zero_column_zero():
    m = torch.randn(10, 2, generator=torch.Generator().manual_seed(0))
    m[:, 0] = 0
    q = orthogonalize(m, "gram_schmidt")
    assert torch.isfinite(q).all() and torch.equal(q[:, 0], torch.zeros(10))
    assert q[:, 1].norm().item() == pytest.approx(1.0)


@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_gram_schmidt_reads_on_the_cpu_and_gives_the_device_paths_values(eps):
    """The CPU path (each column's norm read on the host) and the device path (selects, no
    read) agree bit for bit: ordinary columns, a zero column, one whose fp32 sum of squares
    overflows (norm taken in float64), a NaN column, fp32 and fp64."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        for col, fill in ((None, None), (0, 0.0), (1, 1e20), (0, float("nan")), (1, 0.0)):
            m = torch.randn(40, 2, generator=gen, dtype=dtype)
            if col is not None:
                m[:, col] = fill if fill != 1e20 else m[:, col] * fill
            a, b = gram_schmidt(m.clone(), eps, read=True), gram_schmidt(m.clone(), eps, read=False)
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            if col is None:
                assert torch.allclose(a.t() @ a, torch.eye(2, dtype=dtype), atol=1e-5)


def _power_steps(matrix, rank, steps, comm=None):
    """Decoded approximations of one worker's fixed matrix over warm-started steps (no error feedback)."""
    lay = layer(matrix.shape)
    comp = PowerSGDCompressor(PowerSGDConfig(rank=rank, min_compression_rate=1.0), comm or LocalCommunicator(1))
    outs = []
    for step in range(steps):
        msg = comp.compress(matrix.reshape(-1), lay, step)
        out = torch.zeros(matrix.numel())
        comp.decompress_add(out, msg.tensors, lay, 1.0, msg.ctx)
        comp.commit()   # as the exchange does once every rank finished the step
        outs.append(out.view_as(matrix))
    return comp, outs


def test_powersgd_reconstructs_an_exactly_rank_r_matrix():
    gen = torch.Generator().manual_seed(4)
    matrix = torch.randn(60, 3, generator=gen) @ torch.randn(3, 50, generator=gen)
    comp, outs = _power_steps(matrix, 3, 4, LocalCommunicator(3))   # 3 identical workers: P summed x3
    assert comp.factorizes(layer(matrix.shape), 0)
    for out in outs:
        assert (out - matrix).norm() / matrix.norm() < 1e-5


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation():
    gen = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(80, 80, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen))
    spectrum = torch.tensor([10.0, 8.0, 3.0, 2.5] + [0.5 ** k for k in range(56)])
    matrix = u[:, :60] @ torch.diag(spectrum) @ v.t()
    best = spectrum[2:].square().sum().sqrt()            # Eckart-Young error of rank 2
    _, outs = _power_steps(matrix, 2, 25)
    errors = [(o - matrix).norm().item() for o in outs]
    assert errors[0] > 1.2 * best                        # one random-start iteration: far from it
    assert errors[-1] < best * (1 + 1e-3)                # warm start: power iteration converged


def test_powersgd_recovers_after_an_all_zero_gradient():
    lay = layer((30, 20))
    comp = PowerSGDCompressor(PowerSGDConfig(rank=2), LocalCommunicator(1))
    matrix = torch.randn(30, 2, generator=torch.Generator().manual_seed(1)) @ torch.randn(2, 20)
    for step, x in enumerate([torch.zeros(600), matrix.reshape(-1), matrix.reshape(-1)]):
        msg = comp.compress(x, lay, step)
        out = torch.zeros(600)
        comp.decompress_add(out, msg.tensors, lay, 1.0, msg.ctx)
        comp.commit()
        assert torch.isfinite(out).all()
    assert (out.view(30, 20) - matrix).norm() / matrix.norm() < 1e-5   # not stuck at zero


def test_powersgd_factorises_only_where_torch_would():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress
    comp = PowerSGDCompressor(PowerSGDConfig(rank=4, start_iter=3), LocalCommunicator(1))
    for shape in [(64, 32), (8, 8), (10, 3, 3, 3), (16, 4), (100,), (5, 1000), (1, 500)]:
        lay = layer(shape)
        n, m = shape[0], lay.numel // shape[0]
        torch_says = _should_compress(n, m, min(n, m, 4), 2.0)[0]
        assert comp.factorizes(lay, 3) == torch_says, shape
        assert not comp.factorizes(lay, 2), "compressed before start_iter"
    msg = comp.compress(torch.randn(100), layer((100,)), 5)          # vectors go whole
    assert msg.tensors[0].numel() == 100 and getattr(msg, "ctx", None) is None


def test_powersgd_message_ctx_state_dict_and_missing_ctx():
    lay = layer((64, 32))
    comp = PowerSGDCompressor(PowerSGDConfig(rank=2), LocalCommunicator(1))
    msg = comp.compress(torch.randn(64 * 32), lay, 0)
    assert msg.tensors[0].shape == (32, 2) and msg.ctx.shape == (64, 2)
    assert msg.nbytes() == {"values": 4 * (32 + 64) * 2}              # Q on the wire plus P's allreduce
    assert comp.blocking and comp.error_feedback == "aggregate" and comp.collective == "allreduce"
    with pytest.raises(RuntimeError, match="ctx"):
        comp.decompress_add(torch.zeros(64 * 32), msg.tensors, lay)
    comp.decompress_add(torch.zeros(64 * 32), msg.tensors, lay, 1.0, msg.ctx)
    comp.commit()
    saved = comp.state_dict()
    twin = PowerSGDCompressor(PowerSGDConfig(rank=2), LocalCommunicator(1))
    twin.load_state_dict(saved)
    x = torch.randn(64 * 32)
    a, b = comp.compress(x, lay, 1), twin.compress(x, lay, 1)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.ctx, b.ctx)


def test_powersgd_matches_torchs_hook_under_ddp_driven_directly():
    """Two workers under torchrun; the script plays the exchange's part (runs without the registry)."""
    out = run_torch_script("powersgd_vs_torch.py", "direct").stdout
    assert out.count("OK powersgd direct matches torch") == 2, out


@pytest.mark.skipif("powersgd" not in COMPRESSORS,
                    reason="needs method powersgd registered and the exchange's ctx / error_feedback='aggregate'")
def test_powersgd_matches_torchs_hook_through_register():
    out = run_torch_script("powersgd_vs_torch.py", "register").stdout
    assert out.count("OK powersgd register matches torch") == 2, out
