"""backward_passes_per_step=2: gradients of two micro-batches accumulate (into the residual
for compressed layers) before one exchange; at density 1 this equals single-process SGD on
the sum of all micro-batch losses."""
import copy
import json
import sys

import torch

import redsync_hvd.torch as rhvd


def main(compression):
    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters(),
                                    compression=compression, backward_passes_per_step=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    X, Y = torch.randn(5, size, 2, 4, 12), torch.randint(0, 3, (5, size, 2, 4))
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(5):
        opt.zero_grad()
        for micro in range(2):
            lossf(model(X[step, rank, micro]), Y[step, rank, micro]).backward()
        opt.step()
        ref_opt.zero_grad()
        total = sum(lossf(ref(X[step, r, m]), Y[step, r, m]) for r in range(size) for m in range(2)) / size
        total.backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-5), (p - q).abs().max()
    assert opt.communication_stats()["steps"] == 5
    print(f"rank {rank}: OK accumulate")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
