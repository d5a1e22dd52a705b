"""Local steps' state in one process (``LocalCommunicator``: every rank sends what this one does):
a resume mid-round continues bit for bit, with DiLoCo's outer momentum, the round's snapshot and
counter, and the residuals in the optimizer's state_dict."""
import copy

import pytest
import torch

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.torch import DistributedOptimizer

SPEC = {"method": "redsync", "local_steps": 3, "density": 0.2, "outer_momentum": 0.6, "outer_lr": 0.8,
        "policy": {"min_compress_numel": 0}}


def _build(model, spec):
    return DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model.named_parameters(), spec,
                                communicator=LocalCommunicator(2))


def _train(model, opt, steps, gen):
    for _ in range(steps):
        x = torch.randn(8, 12, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("spec", [SPEC, {**SPEC, "outer_momentum": 0.0, "outer_lr": 1.0}])
def test_a_resume_between_exchanges_continues_bit_for_bit(spec):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = _build(model, spec)
    _train(model, opt, 7, torch.Generator().manual_seed(1))   # two exchanges, one step into the third round
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    delay = saved_opt["redsync"]["delay"]
    assert delay["local"] == 1 and set(delay["outer"]) == ({n for n, _ in model.named_parameters()}
                                                           if spec["outer_momentum"] else set())
    gen = torch.Generator().manual_seed(2)
    _train(model, opt, 5, gen)

    again = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    again.load_state_dict(saved_model)
    opt2 = _build(again, spec)
    opt2.load_state_dict(saved_opt)
    _train(again, opt2, 5, torch.Generator().manual_seed(2))
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name


def test_the_outer_step_moves_the_weights_past_the_average():
    """At density 1 with fp32 values, every rank's delta is this one's: the round's average is the
    local delta, and the outer Nesterov step scales it by outer_lr * (1 + mu) on the first round."""
    torch.manual_seed(0)
    spec = {**SPEC, "density": 1.0, "message": {"quantize": "none"}}
    model = torch.nn.Sequential(torch.nn.Linear(12, 4))
    plain = copy.deepcopy(model)
    opt = _build(model, spec)
    ref = _build(plain, {**spec, "outer_momentum": 0.0, "outer_lr": 1.0})
    start = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 3, torch.Generator().manual_seed(1))
    _train(plain, ref, 3, torch.Generator().manual_seed(1))
    for s, p, q in zip(start, model.parameters(), plain.parameters()):
        assert torch.allclose(p - s, 0.8 * 1.6 * (q - s), atol=1e-6)
