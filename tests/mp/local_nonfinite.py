"""A NaN gradient on one rank under local steps (RedSync's default under horovodrun): that rank
skips the step, the round's exchange fails on every rank with the same error, every rank's
weights go back to the last round's, nothing in the optimizer is NaN, and the next round runs
with the ranks identical. Nothing hangs."""
import json
import sys

import torch

import redsync_hvd.torch as rhvd
from redsync_hvd.exchange import NonFiniteGradientError


def main(options):
    bad_rank = options.pop("bad_rank")
    rhvd.init()
    rank = rhvd.rank()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), compression=options)
    rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
    n = opt.compression_config.local_steps
    assert n == (8 if options["local_steps"] == "auto" else options["local_steps"]), n
    x, y = torch.randn(8, 20) + rank, torch.randint(0, 5, (8,))

    def step(nan=False):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if nan:
            loss = loss * float("nan")
        loss.backward()
        opt.step()

    for _ in range(n):   # one round
        step()
    last = [p.detach().clone() for p in model.parameters()]
    for i in range(n - 1):
        step(nan=i == 1 and rank == bad_rank)   # skipped on that rank
    try:
        step()
        raise AssertionError("the round with a NaN gradient on rank %d passed" % bad_rank)
    except NonFiniteGradientError as error:
        assert "back at the last exchange's" in str(error), str(error)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), last)), "weights not rolled back"
    assert all(torch.isfinite(s["momentum_buffer"]).all() for s in opt.state.values()), "NaN in the momentum"
    for _ in range(n):   # the next round runs
        step()
    everyone = rhvd.allgather_object([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for other in everyone for a, b in zip(other, everyone[0])), "ranks apart"
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), last)), "the next round did not move"
    print(f"rank {rank}: OK local nonfinite {options}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
