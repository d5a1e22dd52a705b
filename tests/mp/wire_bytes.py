"""The cost model's bytes against the wire's, for every method of the exchange registry, on the digits
CNN under ``horovodrun -np 2``: each method trains 12 steps of digits with ``DistributedOptimizer``
(digits' own data, so thresholds and Golomb codes see real gradients); what every rank handed to
its collectives per step (``communication_stats``, averaged over the steps and the ranks)
is compared with what the policy's pricing says a step sends: each compressed layer's
``compressor.wire(layer).nbytes(N)``, each dense layer's values and every bucket's control bytes.
Every method also leaves every rank with the same weights. Prints one JSON line per method:
{"method", "measured", "predicted"}."""
import json

import torch

import redsync_hvd.torch as rhvd
from redsync_hvd.config import registry
from redsync_hvd.data.digits import build_digits
from redsync_hvd.models import build_model

SPECS = {   # each method at the settings of its configs/digits file where it has one, no warm-up, a step's bytes
    "none": {}, "fp16": {}, "topk": {"density": 0.01}, "randomk": {"density": 0.01},
    "redsync": {"density": 0.01, "local_steps": 1, "selection": "radix", "policy": {"min_compress_numel": 1024}},
    "redsync-tbs": {"method": "redsync", "density": 0.01, "local_steps": 1,
                    "selection": {"method": "tbs", "threshold_reuse": 5},
                    "policy": {"min_compress_numel": 1024}},
    "iwp": {"density": 0.01, "policy": {"min_compress_numel": 1024}},
    "sbc": {"density": 0.01, "local_steps": 1, "policy": {"min_compress_numel": 1024}},
    "powersgd": {"rank": 2}, "signsgd": {}, "qsgd": {"bits": 4},
    "threshold": {"threshold": 0.02},
    "dct": {"density": 0.01, "policy": {"min_compress_numel": 1024}},
}


def predicted(opt, size: int) -> float:
    ex = opt.exchange
    comp, dense_each = ex.compressor, (2 if ex.dense_fp16 else 4)
    total = sum(b.control_bytes for b in ex.buckets)
    for layer in ex.layers.values():
        total += comp.wire(layer).nbytes(size) if layer.compressed else dense_each * layer.numel
    return total


def run(label: str, spec: dict, data, size: int) -> dict:
    torch.manual_seed(0)
    model = build_model("cnn", 10, (1, 8, 8))
    compression = {"method": label, **spec} if "method" not in spec else spec
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                    compression=compression)
    rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = data.train.inputs, data.train.targets
    per_step = []
    for step in range(12):
        batch = slice(32 * step, 32 * (step + 1))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        opt.step()
        per_step.append(opt.communication_stats()["last_step"].get("wire_bytes", 0.0))
    mine = sum(per_step) / len(per_step)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    same = all(torch.equal(weights, torch.tensor(w)) for w in rhvd.allgather_object(weights.tolist()))
    assert same, f"{label}: the ranks' weights differ after {len(per_step)} steps"
    measured = sum(rhvd.allgather_object(mine)) / size
    guess = sum(rhvd.allgather_object(predicted(opt, size))) / size   # each rank prices its own messages
    return {"method": label, "measured": measured, "predicted": guess}


def main():
    rhvd.init()
    size = rhvd.size()
    data = build_digits(None, rhvd.rank(), size, 0)
    exchange_methods = {m for m in registry.method_names() if registry.compressor_factory(m) is not None}
    assert exchange_methods <= {s.split("-")[0] for s in SPECS}, exchange_methods
    for label, spec in SPECS.items():
        got = run(label, spec, data, size)
        if rhvd.rank() == 0:
            print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
