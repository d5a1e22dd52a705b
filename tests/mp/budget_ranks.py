"""policy.mode: budget over real Horovod: each rank's gradients have a scale of their own, so
each rank's statistics differ; the averaged statistics and rank 0's broadcast choice make the
k of every layer the same on every rank at every step, and every step after the warm-up
holds the budget (less the statistics' share)."""
import sys

import torch

import redsync_hvd.torch as rhvd
from redsync_hvd.comm import HorovodCommunicator
from redsync_hvd.compressors.base import Layer
from redsync_hvd.engine import build_exchange

SIZES = {"big": 20000, "mid": 6000, "small": 900, "bias": 50}


def main(method: str):
    """``method``: dp or threshold, or descent (dp on what each k buys the loss)."""
    rhvd.init()
    budget = {"method": "dp", "objective": "descent"} if method == "descent" else {"method": method}
    rank = rhvd.rank()
    layers = [Layer(n, (m,), m, i) for i, (n, m) in enumerate(SIZES.items())]
    spec = {"method": "redsync", "density": 0.01, "selection": "radix", "dgc": {"momentum_correction": False},
            "warmup": {"steps": 2},
            "policy": {"mode": "budget", "min_compress_numel": 100, "budget": {"every": 3, **budget}}}
    ex = build_exchange(spec, layers, HorovodCommunicator()).exchange
    total, reserve, history = ex.policy.budget.total, ex.policy.budget.reserve, []
    for step in range(10):
        gen = torch.Generator().manual_seed(100 * rank + step)
        scale = {"big": 0.01 * (1 + 3 * rank), "mid": 1.0 / (1 + rank), "small": 0.3, "bias": 1.0}
        for layer in reversed(layers):
            ex.submit(layer.name, torch.randn(layer.numel, generator=gen) * scale[layer.name])
        ex.finish()
        ks = [l.k for l in layers]
        everyone = rhvd.allgather_object(ks)
        assert all(k == everyone[0] for k in everyone), f"step {step}: ranks use different k {everyone}"
        last = ex.stats.last
        message = last["wire_bytes"] - last.get("bytes_budget", 0)
        # the statistics (sent every 3 steps) are paid out of every step's share
        assert step < 2 or (total - reserve) * 0.99 <= message <= total - reserve, (step, message, total)
        history.append(tuple(ks))
    assert len(set(history[2:])) >= 2, f"no choice changed k: {history}"
    print(f"rank {rank}: OK budget ranks {method} {history[-1]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dp")
