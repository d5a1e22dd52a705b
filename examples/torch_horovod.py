"""The README's five lines, as a complete script: redsync_hvd.torch as a drop-in for
horovod.torch, under horovodrun.

    horovodrun -np 2 -H localhost:2 python examples/torch_horovod.py

Each worker fits a linear classifier to samples of its own (class c: feature c is 1, the rest
noise of about unit norm in all). Under horovodrun RedSync's default (`local_steps: auto`) has
each worker take 8 steps of its own SGD, then send the top 10% of its weight matrix's delta plus
residual (the bias, under 4096 elements, goes dense; docs/redsync.md, "Local steps").
`local_steps: 1` exchanges 0.1% of the gradient every step instead, with DGC's momentum
correction (docs/configuration.md lists each method's defaults).
Rank 0 prints the loss every 20 steps and the exchange's figures at the end.
"""
import json

import torch

import redsync_hvd.torch as rhvd

STEPS = 100

rhvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(1000, 10)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
opt = rhvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                compression={"method": "redsync", "density": 0.001})
rhvd.broadcast_parameters(model.state_dict(), root_rank=0)

data = torch.Generator().manual_seed(1 + rhvd.rank())    # each rank its own samples
for step in range(STEPS + 1):
    y = torch.randint(10, (64,), generator=data)               # class c: feature c is 1, plus noise
    x = torch.randn(64, 1000, generator=data) / 1000 ** 0.5 + torch.nn.functional.one_hot(y, 1000)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rhvd.rank() == 0 and step % 20 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
if rhvd.rank() == 0:
    print("communication_stats:", json.dumps(opt.communication_stats(), default=str), flush=True)
