"""Mixed precision in one process: low-precision gradients, GradScaler's scale, skipped steps.

Every compressor runs through the exchange over a one-process transport standing for 2 ranks;
the Horovod optimizer runs over the same transport, so no launcher is needed. fp16 autocast and
GradScaler run on the CPU in this torch, so the skipped-step semantics are tested end to end."""
import math

import pytest
import torch
from launch import summary, train

from redsync_hvd import checkpoint
from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.config.registry import METHODS as COMPRESSORS
from redsync_hvd.engine import MomentumSpec, build_exchange
from redsync_hvd.torch import DistributedOptimizer
from redsync_hvd.torch.params import layers_of

EVERY = [
    {"method": "none"},
    {"method": "fp16"},
    {"method": "topk", "density": 0.1},
    {"method": "randomk", "density": 0.1},
    {"method": "redsync", "density": 0.05, "dgc": {"momentum_correction": True}},
    {"method": "redsync", "density": 0.05, "message": {"quantize": "fp16"}, "dgc": {"momentum_correction": False}},
    {"method": "iwp", "density": 0.1},
    {"method": "qsgd", "residual": True},
    {"method": "signsgd"},
    {"method": "powersgd", "rank": 2},
    {"method": "sbc", "density": 0.05},
]


def _params():
    torch.manual_seed(0)
    return [("w", torch.nn.Parameter(torch.randn(40, 50))), ("b", torch.nn.Parameter(torch.randn(50)))]


def _exchange(compression, named):
    spec = MomentumSpec(momentum={n: 0.9 for n, _ in named})
    # IWP's leader is drawn among the ranks: a one-process stand-in for 2 would broadcast from nobody
    comm = LocalCommunicator(1 if compression["method"] == "iwp" else 2)
    built = build_exchange({**compression, "policy": {"min_compress_numel": 0}}, layers_of(named), comm,
                           take_momentum=lambda: spec)
    return built.exchange


def _grads(gen, named, dtype=torch.float32):
    return {n: (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype) for n, p in named}


def _memory(ex) -> dict:
    m = ex.memory
    return {**getattr(m, "residual", {}), **{f"u.{k}": v for k, v in getattr(m, "velocity", {}).items()},
            **{f"e.{k}": v for k, v in getattr(m, "error", {}).items()}}


def _step(ex, grads):
    for n, g in grads.items():
        ex.submit(n, g)
    return {n: t.clone() for n, t in ex.finish().averages.items()}


@pytest.mark.skipif(not {c["method"] for c in EVERY} <= set(COMPRESSORS), reason="a baseline is not registered")
@pytest.mark.parametrize("compression", EVERY, ids=lambda c: c["method"] + ("-fp16msg" if "message" in c else ""))
def test_low_precision_gradients_are_exchanged_as_their_fp32_values(compression):
    """bf16 and fp16 gradients: the exchange works on their fp32 values, so every output and
    every residual equals the run fed the same values in fp32, bit for bit, and stays fp32."""
    named = _params()
    for dtype in (torch.bfloat16, torch.float16):
        low, ref = _exchange(compression, named), _exchange(compression, named)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            grads = _grads(gen, named, dtype)
            out = _step(low, grads)
            want = _step(ref, {n: g.float() for n, g in grads.items()})
            for n in want:
                assert out[n].dtype == torch.float32 and torch.equal(out[n], want[n]), (dtype, n)
        kept, again = _memory(low), _memory(ref)
        assert kept.keys() == again.keys()
        assert all(v.dtype == torch.float32 and torch.equal(v, again[k]) for k, v in kept.items()), dtype
        if compression["method"] not in ("none", "fp16"):
            assert kept, "a compressor with error feedback kept no residual"


@pytest.mark.parametrize("compression", [{"method": "redsync", "density": 0.05, "dgc": {"momentum_correction": True}},
                                         {"method": "topk", "density": 0.1}, {"method": "powersgd", "rank": 2},
                                         {"method": "none"}], ids=lambda c: c["method"])
def test_scaled_gradients_keep_unscaled_residuals_and_a_skipped_step_changes_nothing(compression):
    """Gradients multiplied by GradScaler's scale (a power of two: exact) give the unscaled run's
    residuals bit for bit and its outputs times the scale. An overflow step returns inf
    gradients and leaves memory and step count as they were: afterwards the scaled exchange
    still equals an unscaled one that never saw that step."""
    if compression["method"] not in COMPRESSORS:
        pytest.skip("baseline not registered")
    named = _params()
    scaled, plain = _exchange(compression, named), _exchange(compression, named)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaled.use_grad_scaler(scaler)
    gen = torch.Generator().manual_seed(2)
    for step in range(4):
        grads = _grads(gen, named)
        if step == 2:
            before, at = {k: v.clone() for k, v in _memory(scaled).items()}, scaled.step
            bad = {n: g * 4096 for n, g in grads.items()}
            bad["w"][3, 4] = math.inf
            out = _step(scaled, bad)
            assert all(torch.isinf(t).all() for t in out.values()), "an overflow step must hand inf to the scaler"
            assert scaled.step == at and _memory(scaled).keys() == before.keys()
            assert all(torch.equal(before[k], v) for k, v in _memory(scaled).items()), "memory changed on a skip"
            continue
        out = _step(scaled, {n: g * 4096 for n, g in grads.items()})
        want = _step(plain, grads)
        for n in want:
            assert torch.equal(out[n], want[n] * 4096), (step, n)
        assert all(torch.equal(v, _memory(plain)[k]) for k, v in _memory(scaled).items()), step


def test_a_grad_scaler_needs_the_finite_check():
    ex = _exchange({"method": "topk", "density": 0.1, "check_finite": False}, _params())
    with pytest.raises(ValueError, match="check_finite: true"):
        ex.use_grad_scaler(torch.amp.GradScaler("cpu"))
    ex.use_grad_scaler(torch.amp.GradScaler("cpu", enabled=False))   # scales nothing: nothing to do
    assert ex.scaler is None


def _model(dtype=torch.float32):
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(dtype)


def test_horovod_optimizer_writes_pure_bf16_and_fp16_gradients_back_in_their_dtype():
    for dtype in (torch.bfloat16, torch.float16):
        model = _model(dtype)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   {"method": "topk", "density": 0.1, "policy": {"min_compress_numel": 0}},
                                   communicator=LocalCommunicator(2))
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(8, 20, dtype=dtype)).float().square().mean().backward()
        opt.step()
        assert all(p.grad.dtype == dtype for p in model.parameters()), dtype
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), "no update"
        assert all(r.dtype == torch.float32 for r in opt.exchange.residuals().values())


def test_horovod_optimizer_under_fp16_autocast_skips_overflow_steps_without_touching_residuals():
    """fp16 autocast and GradScaler on the CPU, through the optimizer as the runner drives it:
    a scale that overflows fp16 makes the scaler skip the step (weights, residuals and velocities
    unchanged, scale lowered); the next steps train."""
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(),
                               {"method": "redsync", "local_steps": 1, "density": 0.1,
                                "policy": {"min_compress_numel": 0}}, communicator=LocalCommunicator(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    opt.set_grad_scaler(scaler)
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        if step in (2, 3):   # fp16 backward overflows at 2**40; then back to a scale that fits
            scaler.update(new_scale=2.0 ** 40 if step == 2 else 2.0 ** 8)
        memory = {k: v.clone() for k, v in _memory(opt.exchange).items()}
        weights = [p.detach().clone() for p in model.parameters()]
        x = torch.randn(8, 20, generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            scaler.step(opt)
        scale = scaler.get_scale()
        scaler.update()
        same = all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
        if step == 2:
            assert same and scaler.get_scale() < scale, "the overflow step was not skipped"
            assert all(torch.equal(memory[k], v) for k, v in _memory(opt.exchange).items())
        else:
            assert not same and scaler.get_scale() == scale, step
    assert opt.exchange.step == 3 and all(torch.isfinite(v).all() for v in _memory(opt.exchange).values())


def test_local_steps_are_refused_with_a_grad_scaler_and_the_runner_exchanges_every_step_under_fp16(tmp_path):
    """A GradScaler skips a step on the rank that overflowed only, which would move that rank's
    rounds: local steps (auto's too) are refused with the fix; the runner, under training.precision:
    fp16, settles auto to every step."""
    model = _model()
    for steps in ("auto", 4):
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   {"method": "redsync", "local_steps": steps}, communicator=LocalCommunicator(2))
        with pytest.raises(ValueError, match="set compression.local_steps: 1 to train with fp16"):
            opt.set_grad_scaler(torch.amp.GradScaler("cpu"))
    train(tmp_path, "configs/digits/redsync.yaml", "training.precision=fp16", "training.steps=6", "output.name=amp")
    s = summary(tmp_path / "amp")
    assert s["steps"] == 6 and checkpoint.load(tmp_path / "amp", 0)["optimizer"]["redsync"].get("delay") is None, s


def test_sparse_update_is_refused_with_a_grad_scaler():
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                               {"method": "topk", "density": 0.1, "sparse_update": True},
                               communicator=LocalCommunicator(2))
    with pytest.raises(ValueError, match="sparse_update: false"):
        opt.set_grad_scaler(torch.amp.GradScaler("cpu"))
