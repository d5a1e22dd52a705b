"""A NaN gradient on one rank: every rank raises, nothing is applied, residuals stay, training goes on."""
import torch

import redsync_hvd.torch as rhvd
from redsync_hvd.exchange import NonFiniteGradientError

rhvd.init()
rank = rhvd.rank()
torch.manual_seed(0)
model = torch.nn.Linear(64, 32)
opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                compression={"method": "topk", "density": 0.1})
x = torch.randn(8, 64) + rank
for step in range(4):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    if step == 2 and rank == 1:
        loss = loss * float("nan")
    loss.backward()
    before_w = model.weight.detach().clone()
    before_r = {k: v.clone() for k, v in opt.exchange.residuals().items()}
    try:
        opt.step()
    except NonFiniteGradientError as exc:
        assert step == 2, f"unexpected error at step {step}: {exc}"
        assert "non-finite" in str(exc) and "residuals were left" in str(exc), exc
        assert torch.equal(model.weight, before_w), "weights changed on a failed step"
        after_r = opt.exchange.residuals()
        assert all(torch.equal(before_r[k], after_r[k]) for k in before_r), "residual changed on a failed step"
        print(f"rank {rank}: raised at step {step}: {str(exc)[:80]}")
        continue
    assert step != 2, "NaN step did not raise"
    assert torch.isfinite(model.weight).all()
print(f"rank {rank}: OK nonfinite handling")
