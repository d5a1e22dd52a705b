"""RedSync over real allgather: every rank gets exactly the average of what each rank's
message decodes to, ranks select different counts (tbs lands anywhere in [k, 2k], sign
filtering halves it unevenly), and all ranks end with identical gradients. With
``selection.method: radix`` every message has exactly k per layer and travels without a
header allgather."""
import json
import sys

import torch

import redsync_hvd.torch as rhvd
from redsync_hvd.comm import HorovodCommunicator
from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.exchange import GradientExchange
from redsync_hvd.memory import ResidualMemory
from redsync_hvd.policy import LayerPolicy


def main(options):
    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    spec = [("big", 20000), ("mid", 3000), ("small", 64)]
    comp, cfg = build_compressor({"method": "redsync", "policy": {"min_compress_numel": 100}, "fusion_bytes": 40000,
                                  "dgc": {"momentum_correction": False}, **options})
    layers = [Layer(n, (m,), m, i) for i, (n, m) in enumerate(spec)]
    ex = GradientExchange(layers, comp, HorovodCommunicator(), LayerPolicy(cfg), ResidualMemory(),
                          fusion_bytes=cfg.fusion_bytes)
    # a replica of every rank's compressor state lets each rank predict every message
    replicas = [build_compressor(dict(cfg.model_dump()))[0] for _ in range(size)]
    radix = cfg.selection.method == "radix"
    mems = [ResidualMemory() for _ in range(size)]
    counts = []
    for step in range(4):
        grads = [{n: torch.randn(m, generator=torch.Generator().manual_seed(1000 * r + 10 * step + i)) * (r + 1)
                  for i, (n, m) in enumerate(spec)} for r in range(size)]
        for layer in reversed(layers):
            ex.submit(layer.name, grads[rank][layer.name])
        out = ex.finish().averages
        # every rank's messages, as that rank's compressor builds them, by the exchange's steps
        # for a bucket: layer by layer, or (selection.scope: bucket, radix) the layers at once
        sent = {}
        for r in range(size):
            for bucket in ex.buckets:
                if bucket.kind not in ("gather", "planned"):
                    continue
                layers_b = list(bucket.layers)
                msgs = messages_of(replicas[r], mems[r], layers_b, grads[r], step)
                assert not any(bool(m.nonfinite) for m in msgs)
                for l, msg in zip(layers_b, msgs):
                    sent.setdefault(l.name, []).append(msg)
                    counts.append(msg.selected)
                    assert radix is False or msg.tensors[0].numel() == msg.selected == l.k
        for layer in layers:
            if not layer.compressed:
                expect = sum(g[layer.name] for g in grads) / size
            else:
                expect = torch.zeros(layer.numel)
                for msg in sent[layer.name]:
                    replicas[0].decompress_add(expect, msg.tensors, layer)
                expect /= size
            assert torch.allclose(out[layer.name], expect, atol=1e-6), (step, layer.name)
        for m in mems:
            m.commit()
        for layer in layers:
            if layer.compressed:
                assert torch.allclose(ex.residuals()[layer.name], mems[rank].residual[layer.name])
    everyone = rhvd.allgather_object(out["big"].tolist())
    assert all(o == everyone[0] for o in everyone), "ranks ended with different gradients"
    assert radix or len(set(counts)) > 1, "expected uneven selection counts (radix: exactly k, checked above)"
    riders = [b.index for b in ex.buckets if getattr(b, "ride", None) is not None]
    # "small" rides in an allgather where there is one, unless the key is 0 (its bytes fit under auto's cap)
    hosts = any(b.kind == "gather" for b in ex.buckets)
    assert bool(riders) == (hosts and cfg.policy.dense_in_gather_bytes != 0), riders
    by_bucket = any(b in ex.planned or getattr(b, "together", False) for b in ex.buckets)
    assert by_bucket == (cfg.selection.scope == "bucket" or radix)
    headers = ex.communication_stats().get("bytes_headers", 0)
    assert (headers == 0) == radix, f"header bytes {headers}: radix sends none, the others do"
    print(f"rank {rank}: OK redsync exchange {options} counts={sorted(set(counts))[:6]}")


def messages_of(comp, mem, layers, grads, step) -> list:
    """One rank's messages for a bucket, by the exchange's four steps layer by layer (radix: the
    exchange runs them over the bucket's flat buffer, which must give the same messages)."""
    cs = [mem.compensate(l.name, grads[l.name], comp.first_pass(l, step)) for l in layers]
    msgs = comp.compress_bucket([c.x for c in cs], layers, step, [c.first for c in cs])
    for layer, c, msg in zip(layers, cs, msgs):
        mem.update(layer, c.x, msg, comp)
    return msgs


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
