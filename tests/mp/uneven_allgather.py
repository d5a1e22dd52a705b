"""Sparse allgather where ranks send different counts, one of them zero: no hang, exact average."""
import torch

import redsync_hvd.torch as rhvd
from redsync_hvd.comm import HorovodCommunicator
from redsync_hvd.compressors import TopKCompressor, parse_compression
from redsync_hvd.compressors.base import Layer, Message
from redsync_hvd.exchange import GradientExchange
from redsync_hvd.policy import LayerPolicy

COUNTS = {0: 0, 1: 5, 2: 17, 3: 1}   # elements rank r sends for every layer


class RankDependentTopK(TopKCompressor):
    def compress(self, x, layer, step, scan=None):
        k = min(COUNTS[rhvd.rank()] + step, layer.numel) if rhvd.rank() else 0
        idx = torch.topk(x.abs(), k).indices
        return Message([idx.to(layer.index_dtype), x[idx]], ("indices", "values"), selected=k, k=k)


def main():
    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    cfg = parse_compression({"method": "topk", "density": 0.5, "fusion_bytes": 400})
    layers = [Layer("a", (50,), 50, 0), Layer("b", (7, 3), 21, 1), Layer("c", (200,), 200, 2)]
    ex = GradientExchange(layers, RankDependentTopK(cfg), HorovodCommunicator(), LayerPolicy(cfg),
                          fusion_bytes=cfg.fusion_bytes)
    assert len(ex.buckets) >= 2, "test needs several buckets"
    for step in range(3):
        grads = {l.name: torch.randn(l.numel, generator=torch.Generator().manual_seed(100 * rank + l.index + step))
                 for l in layers}
        for l in reversed(layers):
            ex.submit(l.name, grads[l.name])
        out = ex.finish().averages
        # every rank recomputes every rank's selection to know the expected average
        for l in layers:
            expect = torch.zeros(l.numel)
            for r in range(size):
                g = torch.randn(l.numel, generator=torch.Generator().manual_seed(100 * r + l.index + step))
                k = min(COUNTS[r] + step, l.numel) if r else 0
                idx = torch.topk(g.abs(), k).indices
                expect[idx] += g[idx]
            expect /= size
            assert torch.allclose(out[l.name], expect, atol=1e-6), (step, l.name)
    s = ex.stats.summary()
    assert s["bytes_headers"] > 0 and s["steps"] == 3, s
    print(f"rank {rank}: OK uneven allgather (sent {COUNTS[rank]}+step per layer)")


if __name__ == "__main__":
    main()
