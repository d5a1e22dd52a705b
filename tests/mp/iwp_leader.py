"""IWP under horovodrun: every rank applies the same indices, the leader varies across
steps and every rank agrees on it, and models stay identical."""
import torch

import redsync_hvd.torch as rhvd

rhvd.init()
rank, size = rhvd.rank(), rhvd.size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = rhvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1),
    named_parameters=model.named_parameters(),
    compression={"method": "iwp", "density": 0.05, "policy": {"min_compress_numel": 1000}, "seed": 7},
)
rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
comp = opt.exchange.compressor
sent, inner = {}, comp.compress


def compress(x, layer, step, scan=None):   # every message carries the positions it sent
    msg = inner(x, layer, step, scan)
    sent[layer.name] = msg.positions
    return msg


comp.compress = compress
seen = []
for step in range(12):
    x, y = torch.randn(16, 64) * (rank + 1), torch.randint(0, 10, (16,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    seen.append({n: sent[n].tolist() for n in ("0.weight", "2.weight")})
everyone = rhvd.allgather_object({"positions": seen, "leaders": comp.leaders,
                                  "params": [p.detach().clone() for p in model.parameters()]})
for other in everyone[1:]:
    assert other["positions"] == everyone[0]["positions"], "ranks applied different indices"
    assert other["leaders"] == everyone[0]["leaders"], "ranks disagree on the leader"
    assert all(torch.equal(a, b) for a, b in zip(other["params"], everyone[0]["params"])), "models diverged"
leaders = [l for _, l in comp.leaders]
assert len(leaders) == 12 and len(set(leaders)) > 1, leaders
k = max(1, round(0.05 * 64 * 128))
assert all(len(s["0.weight"]) == k for s in seen)
stats = opt.communication_stats()
assert stats["bytes_values"] > 0
print(f"rank {rank}: OK iwp leaders={leaders} ratio={stats['compression_ratio']:.1f}")
