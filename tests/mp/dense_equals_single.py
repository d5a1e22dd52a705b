"""N workers with method none (and topk at density 1) == single-process SGD on the concatenated batches."""
import copy
import sys

import torch

import redsync_hvd.torch as rhvd


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))


def main(compression):
    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    torch.manual_seed(123)
    per = 8
    X = torch.randn(6, size * per, 20)   # 6 steps of a global batch, same on every rank
    Y = torch.randint(0, 5, (6, size * per))
    model = make_model()
    ref = copy.deepcopy(model)
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), compression=compression)
    rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(6):
        xs, ys = X[step, rank * per:(rank + 1) * per], Y[step, rank * per:(rank + 1) * per]
        opt.zero_grad()
        lossf(model(xs), ys).backward()
        opt.step()
        if compression.get("sparse_update"):   # every layer compressed: none has a dense .grad
            assert all(p.grad is None for p in model.parameters()), "sparse_update left a .grad"
        ref_opt.zero_grad()
        lossf(ref(X[step]), Y[step]).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p - q).abs().max().item()
        assert err < 1e-5, f"{compression}: {name} differs from single-process SGD by {err}"
    stats = opt.communication_stats()
    assert stats["steps"] == 6 and stats["wire_bytes"] > 0 and stats["dense_bytes"] > 0, stats
    if compression["method"] == "none":
        # fp32 values plus one 4-byte finite-check scalar per step
        assert stats["wire_bytes"] == stats["dense_bytes"] + 6 * 4, stats
    print(f"rank {rank}: OK {compression}")


if __name__ == "__main__":
    import json
    main(json.loads(sys.argv[1]))
