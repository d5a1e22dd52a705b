"""Compressors and residual memory without communication: the conservation invariant."""
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.memory import ResidualMemory


def run_local(compression, inputs, numel):
    """Feed gradients through memory + compressor the way the exchange does; return sent total and residual."""
    comp, cfg = build_compressor(compression)
    layer = Layer("w", (numel,), numel, 0)
    layer.density = cfg.layer_density()
    mem = ResidualMemory()
    sent = torch.zeros(numel, dtype=torch.float64)
    for step, g in enumerate(inputs):
        x = mem.compensate("w", g).x
        msg = comp.compress(x, layer, step)
        out = torch.zeros(numel)
        comp.decompress_add(out, msg.tensors, layer, ctx=msg.ctx)
        mem.update(layer, x, msg, comp)
        sent += out.double()
        mem.commit()
    return sent, mem.residual["w"].double()


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 300), steps=st.integers(1, 6), density=st.floats(0.001, 1.0),
       method=st.sampled_from(["topk", "randomk"]), seed=st.integers(0, 2**16))
def test_conservation_sent_plus_residual_equals_inputs(numel, steps, density, method, seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(numel, generator=gen) * 10 ** float(torch.randint(-3, 3, (1,), generator=gen))
              for _ in range(steps)]
    sent, residual = run_local({"method": method, "density": density}, inputs, numel)
    total = torch.stack(inputs).double().sum(0)
    assert torch.allclose(sent + residual, total, atol=1e-5 * (1 + total.abs().max().item())), \
        (sent + residual - total).abs().max()


def test_topk_sends_exactly_k_largest():
    comp, cfg = build_compressor({"method": "topk", "density": 0.1})
    x = torch.randn(1000)
    layer = Layer("w", (1000,), 1000, 0, density=0.1)
    msg = comp.compress(x, layer, 0)
    idx, vals = msg.tensors
    assert idx.dtype == torch.int32 and idx.numel() == 100 and msg.k == 100
    assert set(idx.tolist()) == set(torch.topk(x.abs(), 100).indices.tolist())
    assert torch.equal(vals, x[idx.long()])
    assert msg.nbytes() == {"indices": 400, "values": 400}


def test_fp16_halves_bytes():
    comp, _ = build_compressor({"method": "fp16"})
    msg = comp.compress(torch.randn(64), Layer("w", (64,), 64, 0), 0)
    assert msg.tensors[0].dtype == torch.float16 and msg.nbytes()["values"] == 128


def test_randomk_positions_shared_across_ranks_and_change_per_step():
    a, _ = build_compressor({"method": "randomk", "density": 0.1, "seed": 3})
    b, _ = build_compressor({"method": "randomk", "density": 0.1, "seed": 3})
    layer = Layer("w", (500,), 500, 4, density=0.1)
    assert torch.equal(a._positions(layer, 7), b._positions(layer, 7))
    assert not torch.equal(a._positions(layer, 7), a._positions(layer, 8))


def test_density_out_of_range_is_rejected_in_python_too():
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError, match=r"outside \(0, 1\]"):
            build_compressor({"method": "topk", "density": bad})


def test_memory_rollback_restores_residual():
    mem = ResidualMemory()
    x = mem.compensate("w", torch.ones(4)).x
    mem.commit()
    x = mem.compensate("w", torch.full((4,), 5.0)).x
    x.zero_()
    mem.rollback()
    assert torch.equal(mem.residual["w"], torch.ones(4))


CUDA_CASES = [
    {"method": "fp16"},
    {"method": "topk", "density": 0.01},
    {"method": "randomk", "density": 0.01},
    {"method": "redsync", "density": 0.01, "selection": {"method": "trimmed"}, "message": {"quantize": "none"}},
    {"method": "redsync", "density": 0.01, "selection": {"method": "trimmed"}, "message": {"quantize": "sign_mean"}},
    {
        "method": "redsync",
        "density": 0.01,
        "selection": {"method": "trimmed"},
        "message": {"quantize": "fp16", "index_coding": "golomb"},
    },
    {"method": "sbc", "density": 0.01},
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compression", CUDA_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_cuda_tensors_give_the_cpu_result(compression):
    """The same torch path runs on CUDA: messages stay on the GPU and decode to what the
    CPU computes for the same input (deterministic selections only)."""
    numel = 300_000
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 4
    outs = {}
    for device in ("cpu", "cuda"):
        comp, cfg = build_compressor(dict(compression))
        layer = Layer("w", (numel,), numel, 0, device=torch.device(device))
        layer.density = cfg.layer_density()
        x = g.to(device)
        msg = comp.compress(x.clone(), layer, 0)
        out = torch.zeros(numel, device=device)
        comp.decompress_add(out, msg.tensors, layer, ctx=msg.ctx)
        assert out.device.type == device
        outs[device] = out.cpu()
    assert torch.allclose(outs["cpu"], outs["cuda"], rtol=1e-5, atol=1e-6), \
        (outs["cpu"] - outs["cuda"]).abs().max()
