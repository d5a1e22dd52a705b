"""The README's DDP snippet, as a complete script: RedSync as a communication hook of PyTorch's
DistributedDataParallel, under torchrun (Gloo on CPU; no Horovod needed).

    torchrun --standalone --nproc_per_node 2 examples/torch_ddp.py

The same work as examples/torch_horovod.py, with the same default: given the optimizer, the hook
has each worker take 8 steps of its own SGD (register() makes opt.step() the round's local step),
then send the top 10% of its weight matrix's delta plus residual; `local_steps: 1` exchanges 0.1%
of the gradient every step instead. Rank 0 prints the loss every 20 steps and the hook's figures
at the end.
"""
import json

import torch
import torch.distributed as dist

import redsync_hvd.torch.ddp as rddp
from redsync_hvd.launchers import close_process_group

STEPS = 100

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1000, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = rddp.register(model, compression={"method": "redsync", "density": 0.001}, optimizer=opt)

data = torch.Generator().manual_seed(1 + dist.get_rank())        # each rank its own samples
for step in range(STEPS + 1):
    y = torch.randint(10, (64,), generator=data)               # class c: feature c is 1, plus noise
    x = torch.randn(64, 1000, generator=data) / 1000 ** 0.5 + torch.nn.functional.one_hot(y, 1000)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if dist.get_rank() == 0 and step % 20 == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
if dist.get_rank() == 0:
    print("communication_stats:", json.dumps(state.communication_stats(), default=str), flush=True)
# A barrier, then exit at once: torch 2.13's Gloo teardown (destroy_process_group, or the
# interpreter's shut-down) can abort a finished job with "terminate called without an active
# exception" on a loaded machine; after the last collective there is nothing left to lose.
close_process_group()
