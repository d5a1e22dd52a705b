"""Under torchrun (Gloo): DDP with the compression hook == single-process SGD on the concatenated
batches, for methods that send everything (none; RedSync and top-k at density 1; RedSync under
policy.mode cost_model on a link too fast for compression to pay, which takes DDP's own reduction)."""
import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from redsync_hvd.launchers import close_process_group
from redsync_hvd.torch import ddp as rddp

STEPS, PER = 6, 8


def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))


def run(compression):
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(123)
    X = torch.randn(STEPS, size * PER, 20)   # a global batch per step, the same on every rank
    Y = torch.randint(0, 5, (STEPS, size * PER))
    model = make_model()
    ref = copy.deepcopy(model)
    # tiny buckets: several per step once DDP rebuilds them after the first iteration
    ddp = DDP(model, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    state = rddp.register(ddp, compression, optimizer=opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        rows = slice(rank * PER, (rank + 1) * PER)
        opt.zero_grad()
        lossf(ddp(X[step, rows]), Y[step, rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        lossf(ref(X[step]), Y[step]).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = (p - q).abs().max().item()
        assert err < 1e-5, f"{compression}: {name} differs from single-process SGD by {err}"
    stats = state.communication_stats()
    assert stats["steps"] == STEPS and stats["wire_bytes"] > 0, stats
    assert stats["dense_bytes"] == STEPS * 4 * sum(p.numel() for p in model.parameters()), stats
    assert set(stats["layers"]) == {n for n, _ in model.named_parameters()}, stats["layers"]
    if compression["method"] == "none":   # DDP's own reduction: fp32 values, nothing else
        assert stats["wire_bytes"] == stats["dense_bytes"], stats
    if compression.get("policy", {}).get("mode") == "cost_model":   # compression cannot pay on this link
        assert not any(d["compressed"] for d in state.layer_decisions()), state.layer_decisions()
        assert state._fast and stats["wire_bytes"] == stats["dense_bytes"], stats   # DDP's own reduction
    print(f"rank {rank}: OK {json.dumps(compression)}")


def main(specs):
    dist.init_process_group("gloo")
    for spec in specs:     # one launch, several configs: torchrun's start-up dominates
        run(spec)
    close_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
