#!/usr/bin/env python
"""What a one-mean (sign-mean) message does to each layer of a language model, measured.

    python scripts/lm_message_stats.py [--config configs/pydoc/base.yaml] [--density 0.001] [--steps 400]
        [--skip 100] [--out FILE]

One process trains the config's model on its data with RedSync at ``--density`` sending values
(``quantize: none``: residual error feedback, the optimizer's momentum on the sparse update), the
run whose perplexity stays close to dense. At every step after ``--skip``, for each compressed
layer, it takes the positions that RedSync selected from residual + gradient and what sign-mean
would send there (the positives on even steps, the negatives on odd ones, one mean for all of them),
and records:

- ``rel err``: ||v - mean|| / ||v|| over those positions: the part of the selected values that one
  mean does not carry (0: all equal; 1: the mean carries nothing). It stays in the residual, so
  what leaves is the mean, put where the largest values were;
- ``max/mean``: the largest selected magnitude over the mean;
- ``rows`` (2-d weights): how many rows the positions fall in, and the share of |v| that the row
  with the most holds;
- ``row spread``: the largest row's mean |v| over the smallest's: how far apart the magnitudes of
  the rows that share one mean are.

Writes a markdown table (stdout, and ``--out``) with the machine and the command.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.data import build_datasets
from redsync_hvd.experiments.stats import mean, median
from redsync_hvd.experiments.tables import cell, config_arguments, config_of, markdown, one_process_report
from redsync_hvd.memory import ResidualMemory
from redsync_hvd.models import build_model


def one_mean_figures(vals: torch.Tensor, idx: torch.Tensor, shape: tuple, positive: bool) -> dict | None:
    """The figures of one layer's selection (see the module doc), or None if that sign has none."""
    keep = vals > 0 if positive else vals < 0
    v, pos = vals[keep].abs().double(), idx[keep]
    if v.numel() == 0:
        return None
    mean = v.mean()
    out = {"rel_err": float((v - mean).norm() / v.norm()), "max_over_mean": float(v.max() / mean),
           "count": v.numel()}
    if len(shape) == 2:
        rows = pos // shape[1]
        uniq, inverse = rows.unique(return_inverse=True)
        mass = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, v)
        count = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(v))
        row_mean = mass / count
        out.update(rows=len(uniq), top_row_share=float(mass.max() / mass.sum()),
                   row_spread=float(row_mean.max() / row_mean.min()))
    return out


def train(cfg, density: float, steps: int, skip: int) -> dict:
    """1. data, model, SGD as the config says; 2. RedSync (values) with a residual per layer;
    3. every step: compress each large layer, record the one-mean figures, decode the sent values
    into the gradient, step."""
    torch.manual_seed(cfg.training.seed)
    torch.set_num_threads(1)
    data = build_datasets(cfg.data.name, seed=cfg.training.seed, **cfg.data.options)                 # 1.
    model = build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options)
    o = cfg.optimizer
    opt = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    comp, _ = build_compressor({"method": "redsync", "density": density, "message": {"quantize": "none"},
                                "dgc": {"momentum_correction": False}, "selection": {"method": "tbs"}})      # 2.
    memory = ResidualMemory()
    layers = {n: Layer(n, tuple(p.shape), p.numel(), i, density=density) for i, (n, p) in
              enumerate(model.named_parameters()) if p.numel() >= 4096}
    figures: dict = {n: [] for n in layers}
    gen = torch.Generator().manual_seed(cfg.training.seed)
    x_all, y_all = data.train.tensors
    for step in range(steps):                                                                         # 3.
        batch = torch.randint(0, len(x_all), (cfg.training.batch_size,), generator=gen)
        logits = model(x_all[batch])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_all[batch].reshape(-1))
        opt.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            if name not in layers:
                continue
            layer = layers[name]
            x = memory.compensate(name, p.grad.reshape(-1)).x
            msg = comp.compress(x, layer, step)
            if step >= skip:
                got = one_mean_figures(msg.tensors[-1], msg.positions, layer.shape, positive=step % 2 == 0)
                if got is not None:
                    figures[name].append(got)
            sent = torch.zeros_like(x)
            comp.decompress_add(sent, msg.tensors, layer)
            memory.update(layer, x, msg, comp)
            memory.commit()
            p.grad.copy_(sent.view_as(p.grad))
        opt.step()
    return {n: (layers[n], figs) for n, figs in figures.items()}


def table(results: dict) -> str:
    head = ["layer", "shape", "k", "rel err (mean)", "max/mean (median)", "rows (mean)", "top row share",
            "row spread (median)"]
    lines = []
    for name, (layer, figs) in results.items():
        def of(key):
            return [f[key] for f in figs if key in f]
        lines.append([name, "x".join(map(str, layer.shape)), layer.k, cell(mean(of("rel_err")), ".3f"),
                      cell(median(of("max_over_mean")), ".1f"), cell(mean(of("rows")), ".1f"),
                      cell(mean(of("top_row_share")), ".2f"), cell(median(of("row_spread")), ".1f")])
    return markdown(head, lines, "llrrrrrr")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(ap, "configs/pydoc/base.yaml")
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--skip", type=int, default=100, help="steps before the figures are recorded")
    args = ap.parse_args(argv)
    cfg = config_of(args)
    t0 = time.time()
    results = train(cfg, args.density, args.steps, args.skip)
    one_process_report(argv, "scripts/lm_message_stats.py",
                       f"{cfg.model.name} on {cfg.data.name}, density {args.density}, steps {args.skip}-{args.steps}",
                       time.time() - t0, table(results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
