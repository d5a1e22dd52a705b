"""How well each worker's Adam moments estimate dense AdamW's variance of the average gradient.

    python -m redsync_hvd.experiments.variance_estimate [--config configs/austen/gpt-dense.yaml]
        [--workers 2] [--steps 800] [--every 200] [--out FILE]

Under local steps with ``adam_variance: shared`` every worker divides by one estimate of the
variance of the N workers' average gradient, averaged at each exchange. Dense AdamW divides by the
exponential average of that average's square, which no worker sees. One process trains the
config's model with dense AdamW on the average of N simulated workers' gradients (each its own
batch, the learning-rate schedule of the config) and keeps each worker's own moments beside it.
At every ``--every`` steps, for each layer of 4,096 elements or more, it compares with dense's
v_hat three estimates the workers could share (:func:`estimates`):

- ``shared``: the mean over the workers of v_hat_i / N + (1 - 1/N) m_hat_i**2
  (``memory/adam.py:average_variance``, what ``adam_variance: shared`` averages);
- ``mean_v``: the mean of the workers' v_hat_i (right where the gradient is the same on every
  worker, N times too large where it is independent noise);
- ``spread``: mean_v less the workers' noise, read from the spread of their m_hat_i:
  an EMA of white noise of variance s2 has variance s2 (1 - b1) / (1 + b1).

Each figure is the length of Adam's step with that denominator over dense's,
||m_hat / sqrt(est)|| / ||m_hat / sqrt(v_hat)|| (1: dense's step; above 1: a longer step), and
the median over the layer's elements of est / v_hat. Writes a markdown table (stdout, and
``--out``) with the machine and the command.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from ..data import build_datasets
from ..models import build_model
from ..schedule import lr_factor
from ..torch.training import build_optimizer
from .tables import cell, config_arguments, config_of, markdown, one_process_report

ESTIMATES = ("shared", "mean_v", "spread")


def estimates(m_hat: torch.Tensor, v_hat: torch.Tensor, b1: float) -> dict:
    """{name: estimate of the average gradient's second moment} from the workers' bias-corrected
    moments ``m_hat``, ``v_hat`` (one row per worker)."""
    n = m_hat.shape[0]
    mean_v = v_hat.mean(0)
    shared = (v_hat / n + (1 - 1 / n) * m_hat ** 2).mean(0)
    noise = m_hat.var(0, unbiased=True) * (1 + b1) / (1 - b1)   # each worker's gradient noise
    spread = torch.maximum(mean_v - (1 - 1 / n) * noise, mean_v / n)
    return {"shared": shared, "mean_v": mean_v, "spread": spread}


def compare(est: torch.Tensor, m_hat: torch.Tensor, v_hat: torch.Tensor, eps: float) -> tuple:
    """(Adam's step length with ``est`` over dense's, median of est / v_hat)."""
    ratio = (m_hat / (est.sqrt() + eps)).norm() / (m_hat / (v_hat.sqrt() + eps)).norm()
    return float(ratio), float((est / v_hat.clamp_min(1e-30)).median())


def train(cfg, workers: int, steps: int, every: int) -> list:
    """1. data, model and AdamW as the config says; 2. each step N batches, each worker's moments
    from its own gradient, dense AdamW on their average; 3. every ``every`` steps, the figures."""
    torch.manual_seed(cfg.training.seed)
    data = build_datasets(cfg.data.name, seed=cfg.training.seed, **cfg.data.options)                 # 1.
    model = build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options)
    opt = build_optimizer(cfg, model, 1)
    factor, base = lr_factor(cfg, steps), [g["lr"] for g in opt.param_groups]   # training.steps: steps
    (b1, b2), eps = cfg.optimizer.betas, cfg.optimizer.eps
    large = {n: p for n, p in model.named_parameters() if p.numel() >= 4096}
    m = {n: torch.zeros(workers, p.numel()) for n, p in large.items()}
    v = {n: torch.zeros(workers, p.numel()) for n, p in large.items()}
    gen = torch.Generator().manual_seed(cfg.training.seed)
    x_all, y_all = data.train.tensors
    rows = []
    for step in range(1, steps + 1):                                                                  # 2.
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * factor(step - 1)
        opt.zero_grad()
        for i in range(workers):
            seen = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in large.items()}
            batch = torch.randint(0, len(x_all), (cfg.training.batch_size,), generator=gen)
            logits = model(x_all[batch])
            (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_all[batch].reshape(-1)) / workers).backward()
            for n, p in large.items():
                g = (p.grad - seen[n]).reshape(-1) * workers
                m[n][i].lerp_(g, 1 - b1)
                v[n][i].mul_(b2).addcmul_(g, g, value=1 - b2)
        opt.step()
        if step % every:
            continue
        c1, c2 = 1 - b1 ** step, 1 - b2 ** step                                                        # 3.
        for n, p in large.items():
            state = opt.state[p]
            m_hat, v_hat = state["exp_avg"].reshape(-1) / c1, state["exp_avg_sq"].reshape(-1) / c2
            got = estimates(m[n] / c1, v[n] / c2, b1)
            rows.append((step, n, {k: compare(got[k], m_hat, v_hat, eps) for k in ESTIMATES}))
    return rows


def table(rows: list) -> str:
    head = ["step", "layer", *(f"{k}: step" for k in ESTIMATES), *(f"{k}: median est/v" for k in ESTIMATES)]
    lines = [[str(step), name, *(cell(figs[k][0], ".3f") for k in ESTIMATES),
              *(cell(figs[k][1], ".3f") for k in ESTIMATES)] for step, name, figs in rows]
    return markdown(head, lines, "ll" + "r" * 2 * len(ESTIMATES))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(ap, "configs/austen/gpt-dense.yaml")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--every", type=int, default=200)
    args = ap.parse_args(argv)
    cfg = config_of(args, f"training.steps={args.steps}")
    if cfg.optimizer.name not in ("adam", "adamw"):
        ap.error(f"{args.config}: optimizer {cfg.optimizer.name}; this compares Adam's variance estimates")
    t0 = time.time()
    rows = train(cfg, args.workers, args.steps, args.every)
    one_process_report(argv, "-m redsync_hvd.experiments.variance_estimate",
                       f"{cfg.model.name} on {cfg.data.name} under {cfg.optimizer.name}, {args.workers} simulated "
                       f"workers, dense AdamW on their average, {args.steps} steps", time.time() - t0,
                       table(rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
