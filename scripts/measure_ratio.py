"""Measure the compression ratio of a compression config on the reference models.

    python scripts/measure_ratio.py [--density 0.001] [--steps 5] [--set quantize=sign_mean ...]

Runs a few real training steps of each model (synthetic inputs of the model's
shape) through DistributedOptimizer and reports the bytes it put into collectives
against dense fp32 allreduce of the same gradients. The ratio is per worker and does
not depend on the number of workers, so one process is enough (Horovod, size 1).
"""
from __future__ import annotations

import argparse

import torch
import yaml

import redsync_hvd.torch as rhvd
from redsync_hvd.models import build_model

MODELS = {  # name: (model, num_classes, input_shape, options)
    "digits cnn": ("cnn", 10, (1, 8, 8), {}),
    "resnet20": ("resnet20", 10, (3, 32, 32), {}),
    "vgg (fc 4096)": ("vgg", 10, (3, 32, 32), {"fc_width": 4096}),
    "lstm_lm (10k vocab, 650)": ("lstm_lm", 10000, (35,), {"embed_dim": 650, "hidden": 650}),
}


def measure(name, spec, compression, steps, batch):
    kind, classes, shape, options = spec
    torch.manual_seed(0)
    model = build_model(kind, classes, shape, **options)
    opt = rhvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(), compression=compression
    )
    for _ in range(steps):
        if kind == "lstm_lm":
            x = torch.randint(0, classes, (batch,) + shape)
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, classes), x.reshape(-1))
        else:
            x, y = torch.randn((batch,) + shape), torch.randint(0, classes, (batch,))
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    s = opt.communication_stats()
    params = sum(p.numel() for p in model.parameters())
    compressed = sum(d["numel"] for d in opt.layer_decisions() if d["compressed"])
    return {"model": name, "params": params, "compressed_share": compressed / params,
            "wire_bytes_per_step": s["wire_bytes"] / s["steps"], "dense_bytes_per_step": s["dense_bytes"] / s["steps"],
            "ratio": s["compression_ratio"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra compression knobs, e.g. quantize=fp16")
    args = ap.parse_args()
    compression = {"method": "redsync", "density": args.density, "message": {"quantize": "sign_mean"}}
    for item in args.overrides:
        key, _, value = item.partition("=")
        compression[key] = yaml.safe_load(value)
    rhvd.init()
    print(f"compression: {compression}\n")
    print("| model | parameters | share compressed | wire bytes/step | dense bytes/step | ratio |")
    print("|---|---|---|---|---|---|")
    for name, spec in MODELS.items():
        r = measure(name, spec, compression, args.steps, args.batch)
        print(f"| {r['model']} | {r['params']:,} | {r['compressed_share']:.4f} | {r['wire_bytes_per_step']:,.0f} "
              f"| {r['dense_bytes_per_step']:,.0f} | {r['ratio']:.0f}x |")


if __name__ == "__main__":
    main()
