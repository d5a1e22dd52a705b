"""``sparse_update``: compressed layers' averaged sparse gradients applied straight to the weights.

In-process with ``LocalCommunicator`` (every rank sends what this one sends); the real
horovodrun check is ``test_multiprocess.py::test_dense_equals_single_process``.
"""
import pytest
import torch

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.exchange import NonFiniteGradientError
from redsync_hvd.torch import DistributedOptimizer

BASE = {   # an exchange every step: sparse_update applies each step's average inside step()
    "method": "redsync",
    "local_steps": 1,
    "density": 0.05,
    "message": {"quantize": "sign_mean"},
    "dgc": {"momentum_correction": True},
    "policy": {"min_compress_numel": 200},
    "selection": {"method": "tbs"},
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 4))


def _opt(model, **extra):
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    return DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                compression={**BASE, **extra}, communicator=LocalCommunicator(2))


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 40, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("quantize", ["sign_mean", "none"])
def test_sparse_update_gives_the_weights_of_the_dense_gradient_path(quantize):
    a, b = _model(), _model()
    message = {"quantize": quantize}
    opt_a, opt_b = _opt(a, message=message), _opt(b, message=message, sparse_update=True)
    lossf = torch.nn.CrossEntropyLoss()
    for x, y in _batches(8):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            lossf(model(x), y).backward()
            opt.step()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.allclose(p, q, atol=1e-6, rtol=0), (quantize, name, (p - q).abs().max())
    compressed = {d["name"] for d in opt_b.layer_decisions() if d["compressed"]}
    assert compressed == {"0.weight"}       # 1200 elements; the rest are under 200
    for name, p in b.named_parameters():
        assert (p.grad is None) == (name in compressed), name
    assert all(p.grad is not None for p in a.parameters())


def test_explicit_synchronize_still_gives_dense_gradients():
    model = _model()
    opt = _opt(model, sparse_update=True)
    x, y = _batches(1)[0]
    torch.nn.CrossEntropyLoss()(model(x), y).backward()
    opt.synchronize()                   # e.g. to clip: every .grad is the dense average
    assert all(p.grad is not None for p in model.parameters())
    with opt.skip_synchronize():
        opt.step()
    assert all(p.grad is not None for p in model.parameters())


def test_sparse_update_leaves_the_weights_alone_on_a_nan_step():
    model = _model()
    opt = _opt(model, sparse_update=True)
    lossf = torch.nn.CrossEntropyLoss()
    x, y = _batches(1)[0]
    for _ in range(2):
        opt.zero_grad()
        lossf(model(x), y).backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    # a NaN in a dense layer only: found in finish(), after the sparse messages have arrived
    hook = model[2].bias.register_hook(lambda g: torch.full_like(g, float("nan")))
    lossf(model(x), y).backward()
    hook.remove()
    with pytest.raises(NonFiniteGradientError):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize(
    "make, extra, problem",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"dgc": {"momentum_correction": False}}, "momentum=0.9"),
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1),
            {"dgc": {"momentum_correction": False}},
            "weight_decay=0.1",
        ),
        (lambda ps: torch.optim.Adam(ps, lr=0.1), {}, "not torch.optim.SGD"),
    ],
)
def test_sparse_update_refuses_optimizers_that_are_not_plain_sgd(make, extra, problem):
    model = _model()
    with pytest.raises(ValueError, match=problem) as err:
        DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                             compression={**BASE, **extra, "sparse_update": True}, communicator=LocalCommunicator(2))
    assert "sparse_update: false" in str(err.value)


def test_sparse_update_is_not_a_knob_of_allreduce_methods():
    from redsync_hvd.compressors import parse_compression
    with pytest.raises(ValueError, match="sparse_update: unknown key"):
        parse_compression({"method": "randomk", "sparse_update": True})


COST_MODEL = {"mode": "cost_model", "min_compress_numel": 200, "latency_s": 1e-4, "bandwidth_gbit": 0.01,
              "compute_s": [1e-5, 1e-9], "overlap": 0.0}


def test_auto_under_the_cost_model_applies_in_step_where_the_optimizer_is_plain_sgd_and_says_so():
    """sparse_update: auto (the default) is on under policy.mode: cost_model where momentum correction
    leaves a plain SGD, and the weights are those of the dense gradient path; with the momentum
    still in the optimizer, under the static policy, or with a GradScaler, it stays off. Each
    choice under the cost model is a line of the decisions' notes (layers.log); so is the
    threshold reuse the cost model's auto picks."""
    a, b = _model(), _model()
    opt_a = _opt(a, policy=COST_MODEL, sparse_update=False)
    opt_b = _opt(b, policy=COST_MODEL)
    notes = opt_b.exchange.decision_record()["notes"]
    assert opt_b._sparse_update and any("sparse_update: true (auto" in n for n in notes), notes
    assert any("threshold_reuse: 5 (auto" in n for n in notes), notes
    assert opt_b.compression_config.selection.threshold_reuse == 5
    lossf = torch.nn.CrossEntropyLoss()
    for x, y in _batches(4):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            lossf(model(x), y).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    assert any(p.grad is None for p in b.parameters())   # the compressed layer was applied in step()
    kept = _opt(_model(), policy=COST_MODEL, dgc={"momentum_correction": False})
    assert not kept._sparse_update
    assert any("sparse_update: false (auto): param group 0 has momentum=0.9" in n
               for n in kept.exchange.decision_record()["notes"])
    static = _opt(_model())
    assert not static._sparse_update and static.compression_config.selection.threshold_reuse == 1
    scaled = _opt(_model(), policy=COST_MODEL)
    scaled.set_grad_scaler(torch.amp.GradScaler("cpu"))
    assert not scaled._sparse_update and "GradScaler" in scaled.exchange.decision_record()["notes"][-1]
