"""Under torchrun (Gloo): 3 steps, save (model, optimizer, hook state), rebuild everything from
other weights, load, 3 more steps == 6 steps straight, bit for bit: weights, residuals,
velocities and byte counts."""
import io
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from redsync_hvd.launchers import close_process_group
from redsync_hvd.torch import ddp as rddp

STEPS, PER = 6, 8


def build(spec, init_seed):
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, opt, rddp.register(ddp, spec, optimizer=opt)


def train(ddp, opt, batches):
    lossf = torch.nn.CrossEntropyLoss()
    for x, y in batches:
        opt.zero_grad()
        lossf(ddp(x), y).backward()
        opt.step()


def memory_of(state) -> dict:
    memory = state.exchange.memory
    return {**getattr(memory, "residual", {}), **{f"u.{k}": v for k, v in getattr(memory, "velocity", {}).items()}}


def run(spec):
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [(torch.randn(PER, 30, generator=gen), torch.randint(0, 4, (PER,), generator=gen))
               for _ in range(STEPS)]
    straight, ddp, opt, state = build(spec, 1)
    train(ddp, opt, batches)
    first, ddp_b, opt_b, state_b = build(spec, 1)
    train(ddp_b, opt_b, batches[:3])
    blob = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt_b.state_dict(), "hook": state_b.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, weights_only=False)
    resumed, ddp_c, opt_c, state_c = build(spec, 99)   # other weights: all must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    state_c.load_state_dict(saved["hook"])
    train(ddp_c, opt_c, batches[3:])
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), f"{spec}: {name} differs after resume by {(p - q).abs().max().item()}"
    kept, again = memory_of(state), memory_of(state_c)
    assert kept and kept.keys() == again.keys(), (kept.keys(), again.keys())
    for name in kept:
        assert torch.equal(kept[name], again[name]), f"{spec}: memory {name} differs after resume"
    a, b = state.communication_stats(), state_c.communication_stats()
    assert (a["steps"], a["wire_bytes"]) == (b["steps"], b["wire_bytes"]), (a, b)
    print(f"rank {rank}: OK resume {json.dumps(spec)}")


def main(specs):
    dist.init_process_group("gloo")
    for spec in specs:     # one launch, several configs: torchrun's start-up dominates
        run(spec)
    close_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
