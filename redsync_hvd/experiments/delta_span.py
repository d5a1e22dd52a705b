"""How far apart the values of one local-steps exchange are, and what int8 and fp16 lose on them.

    python -m redsync_hvd.experiments.delta_span [--config configs/austen/gpt-dense.yaml] [--local-steps 8]
        [--density 0.1] [--steps 400] [--out FILE]

One process trains the config's model with its optimizer (no learning-rate schedule), and every
``--local-steps`` steps takes the top ``--density`` of each large layer's delta plus residual, as
RedSync's default local steps do (exact top-k here; the rest stays in the residual, and the
weights restart from the old ones plus what was sent, as one worker of many would). For each
layer it records, over the exchanges:

- ``span``: the largest selected |v| over the smallest: how many of int8's 127 levels per sign
  the values use (a span of 2 leaves the smallest value 63 levels);
- ``int8 err``, ``fp16 err``: ||decoded - v|| / ||v|| over the selected values for int8 with one
  scale per layer (``message.quantize: int8``) and for fp16: what rounding leaves in the residual.

Writes a markdown table (stdout, and ``--out``) with the machine and the command.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from ..compressors.codec import MessageCodec
from ..core.select import Contract, select, single
from ..data import build_datasets
from ..models import build_model
from ..torch.training import build_optimizer
from .stats import mean, median
from .tables import cell, config_arguments, config_of, markdown, one_process_report

CODECS = {q: MessageCodec(q) for q in ("int8", "fp16")}
EXACT = Contract("exact", finite=False)


def rounding_error(codec: MessageCodec, v: torch.Tensor) -> float:
    """||decoded - v|| / ||v|| of ``v`` sent through ``codec``'s values."""
    return float((codec.decoded(codec.to_wire(v)) - v).norm() / v.norm())


def train(cfg, local_steps: int, density: float, steps: int) -> dict:
    """1. data, model and optimizer as the config says; 2. local steps; 3. at each exchange, per large
    layer: the top ``density`` of delta + residual, its figures, the rest kept, the weights reset."""
    torch.manual_seed(cfg.training.seed)
    data = build_datasets(cfg.data.name, seed=cfg.training.seed, **cfg.data.options)                 # 1.
    model = build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options)
    opt = build_optimizer(cfg, model, 1)
    large = {n: p for n, p in model.named_parameters() if p.numel() >= 4096}
    snapshot = {n: p.detach().clone() for n, p in large.items()}
    residual = {n: torch.zeros(p.numel()) for n, p in large.items()}
    figures: dict = {n: [] for n in large}
    gen = torch.Generator().manual_seed(cfg.training.seed)
    x_all, y_all = data.train.tensors
    for step in range(1, steps + 1):                                                                  # 2.
        batch = torch.randint(0, len(x_all), (cfg.training.batch_size,), generator=gen)
        logits = model(x_all[batch])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_all[batch].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % local_steps:
            continue
        with torch.no_grad():                                                                         # 3.
            for name, p in large.items():
                x = (p - snapshot[name]).reshape(-1) + residual[name]
                idx = select(single(x.numel(), max(1, int(density * x.numel()))), x, EXACT).positions
                v = x[idx]
                span = float(v.abs().max() / v.abs().min().clamp_min(1e-30))
                figures[name].append({"span": span, **{q: rounding_error(c, v) for q, c in CODECS.items()}})
                residual[name] = x.index_fill(0, idx, 0.0)
                snapshot[name] += (x - residual[name]).view_as(p)
                p.copy_(snapshot[name])
    return {n: (tuple(large[n].shape), figs) for n, figs in figures.items()}


def table(results: dict) -> str:
    head = ["layer", "shape", "span (median)", "span (max)", "int8 err (mean)", "fp16 err (mean)"]
    lines = [[name, "x".join(map(str, shape)), cell(median([f["span"] for f in figs]), ".2f"),
              cell(max(f["span"] for f in figs), ".2f"), cell(mean([f["int8"] for f in figs]), ".4f"),
              cell(mean([f["fp16"] for f in figs]), ".5f")] for name, (shape, figs) in results.items()]
    return markdown(head, lines, "llrrrr")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(ap, "configs/austen/gpt-dense.yaml")
    ap.add_argument("--local-steps", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args(argv)
    cfg = config_of(args)
    t0 = time.time()
    results = train(cfg, args.local_steps, args.density, args.steps)
    one_process_report(argv, "-m redsync_hvd.experiments.delta_span",
                       f"{cfg.model.name} on {cfg.data.name} under {cfg.optimizer.name}, {args.local_steps} local "
                       f"steps, the top {args.density:g} of each delta, {args.steps} steps", time.time() - t0,
                       table(results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
