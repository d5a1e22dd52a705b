"""Which part of local AdamW steps costs a model perplexity: the workers' drift, or a denominator
that is only as fresh as the last exchange.

    python -m redsync_hvd.experiments.local_adam [--config configs/austen/gpt-dense.yaml]
        [--workers 2] [--local-steps 2] [--denominator fresh|stale|shared|own] [--refresh K]
        [--steps 800] [--every 200] [--out FILE]

With 2 local steps, the whole delta averaged and ``adam_variance: shared`` (the nearest local steps
come to dense AdamW) the Austen GPT still ends 3.6% above dense, the long one 7.4%. Two things
separate that run from dense AdamW on the workers' average gradient: between exchanges each worker
steps from its own weights with its own momentum (drift), and it divides by an estimate of the
average's variance made at the last exchange (staleness). One process holds N copies of the
config's model and trains them as the local steps do (each worker its own batch, the config's
schedule and decoupled weight decay, every ``--local-steps`` steps the weights averaged, each
worker's moments kept), dividing by one of:

- ``fresh``: dense AdamW's v of the workers' average gradient, updated every step (each gradient
  at its worker's weights). No real run has it between exchanges: it takes the drift alone.
- ``stale``: the same v as it was at the last refresh, every ``--refresh`` steps (default: at
  each exchange), floored as ``shared`` is (below). With ``--local-steps 1`` it takes the
  staleness alone; 1 and fresh is dense AdamW.
- ``shared``: what ``adam_variance: shared`` divides by (``memory/adam.py:average_variance``,
  averaged over the workers at each exchange; a worker's own estimate / N where larger).
- ``own``: each worker's own v.

Writes the test perplexity every ``--every`` steps as a markdown table (stdout, and ``--out``) with
the machine and the command.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch
import torch.nn.functional as F

from ..data import build_datasets
from ..memory.adam import average_variance
from ..models import build_model
from ..schedule import lr_factor
from ..torch.training import param_groups
from .tables import config_arguments, config_of, markdown, one_process_report

DENOMINATORS = ("fresh", "stale", "shared", "own")


class Workers:
    """N copies of a model with their own AdamW moments; ``dense_v``: v of their average gradient."""

    def __init__(self, cfg, model, workers: int):
        self.n, self.o = workers, cfg.optimizer
        decay = {id(p): g.get("weight_decay", self.o.weight_decay) for g in param_groups(model, self.o.no_decay)
                 for p in g["params"]}
        self.decay = {name: decay[id(p)] for name, p in model.named_parameters()}
        self.models = [copy.deepcopy(model) for _ in range(workers)]
        self.params = [dict(m.named_parameters()) for m in self.models]
        zeros = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
        self.m = [{k: z.clone() for k, z in zeros.items()} for _ in range(workers)]
        self.v = [{k: z.clone() for k, z in zeros.items()} for _ in range(workers)]
        self.dense_v = {k: z.clone() for k, z in zeros.items()}
        self.frozen = None   # the denominator's v as it was at the last refresh (stale, shared)

    def gradients(self, x, y, batches: list) -> list:
        out = []
        for model, batch in zip(self.models, batches):
            model.zero_grad()
            logits = model(x[batch])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[batch].reshape(-1)).backward()
            out.append({name: p.grad.detach().clone() for name, p in model.named_parameters()})
        return out

    @torch.no_grad()
    def step(self, grads: list, t: int, lr: float, denominator: str) -> None:
        """1. every worker's moments and dense's v; 2. each worker's step with the chosen denominator."""
        (b1, b2), eps = self.o.betas, self.o.eps
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        for name in self.dense_v:                                                                      # 1.
            avg = sum(g[name] for g in grads) / self.n
            self.dense_v[name].mul_(b2).addcmul_(avg, avg, value=1 - b2)
            for i, g in enumerate(grads):
                self.m[i][name].lerp_(g[name], 1 - b1)
                self.v[i][name].mul_(b2).addcmul_(g[name], g[name], value=1 - b2)
            for i in range(self.n):                                                                    # 2.
                d = self._denominator(name, i, c1, c2, denominator).sqrt_().add_(eps)
                p = self.params[i][name]
                p.mul_(1 - lr * self.decay[name]).addcdiv_(self.m[i][name], d, value=-lr / c1)

    def _denominator(self, name: str, i: int, c1: float, c2: float, kind: str) -> torch.Tensor:
        if kind == "own":
            return self.v[i][name] / c2
        if kind == "fresh" or self.frozen is None:
            return self.dense_v[name] / c2 if kind != "shared" else self._own_estimate(name, i, c1, c2)
        # a stale v is about 0 for a gradient the refresh had not seen: both floor it, as the project
        # does, at the worker's own estimate / N (without it both GPTs diverged within 400 steps)
        return torch.maximum(self.frozen[name], self._own_estimate(name, i, c1, c2) / self.n)

    def _own_estimate(self, name: str, i: int, c1: float, c2: float) -> torch.Tensor:
        return average_variance(self.m[i][name], self.v[i][name], c1, c2, self.n)

    @torch.no_grad()
    def refresh(self, t: int, kind: str) -> None:
        """stale: dense's v now; shared: the workers' estimates averaged (bias-corrected at t)."""
        b1, b2 = self.o.betas
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        if kind == "stale":
            self.frozen = {k: v / c2 for k, v in self.dense_v.items()}
        elif kind == "shared":
            self.frozen = {k: sum(self._own_estimate(k, i, c1, c2) for i in range(self.n)) / self.n
                           for k in self.dense_v}

    @torch.no_grad()
    def average(self) -> None:
        for name in self.dense_v:
            mean = sum(p[name] for p in self.params) / self.n
            for p in self.params:
                p[name].copy_(mean)


@torch.no_grad()
def perplexity(model, data, batch: int = 256) -> float:
    model.eval()
    x, y = data.test.tensors
    total = 0.0
    for a in range(0, len(x), batch):
        logits = model(x[a:a + batch])
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[a:a + batch].reshape(-1),
                                       reduction="sum"))
    model.train()
    return math.exp(min(total / y.numel(), 700.0))   # a diverged run reads as about 1e304


def train(cfg, workers: int, local_steps: int, denominator: str, refresh: int, steps: int, every: int) -> list:
    """1. data and model as the config says; 2. each step N batches and every worker's step;
    3. every ``local_steps`` the weights averaged, every ``refresh`` the denominator; 4. the test
    perplexity of the average every ``every`` steps (after an exchange: the workers agree)."""
    torch.manual_seed(cfg.training.seed)
    data = build_datasets(cfg.data.name, seed=cfg.training.seed, **cfg.data.options)                 # 1.
    group = Workers(cfg, build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options),
                    workers)
    factor, gen = lr_factor(cfg, steps), torch.Generator().manual_seed(cfg.training.seed)
    x, y = data.train.tensors
    rows = []
    for t in range(1, steps + 1):
        batches = [torch.randint(0, len(x), (cfg.training.batch_size,), generator=gen) for _ in range(workers)]
        group.step(group.gradients(x, y, batches), t, cfg.optimizer.lr * factor(t - 1), denominator)       # 2.
        if t % local_steps == 0:                                                                      # 3.
            group.average()
        if t % refresh == 0:
            group.refresh(t, denominator)
        if t % every == 0 or t == steps:                                                              # 4.
            rows.append((t, perplexity(group.models[0], data)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_arguments(ap, "configs/austen/gpt-dense.yaml")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--local-steps", type=int, default=2)
    ap.add_argument("--denominator", choices=DENOMINATORS, default="fresh")
    ap.add_argument("--refresh", type=int, default=None, help="steps between refreshes of a stale or shared "
                                                               "denominator (default: --local-steps)")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--every", type=int, default=200)
    args = ap.parse_args(argv)
    cfg = config_of(args, f"training.steps={args.steps}")
    if cfg.optimizer.name != "adamw" or cfg.data.name not in ("austen", "pydoc"):
        ap.error(f"{args.config}: this takes a language model under AdamW")
    refresh = args.refresh or args.local_steps
    t0 = time.time()
    rows = train(cfg, args.workers, args.local_steps, args.denominator, refresh, args.steps, args.every)
    body = markdown(["step", "test perplexity"], [[str(t), f"{p:.2f}"] for t, p in rows], "rr")
    one_process_report(argv, "-m redsync_hvd.experiments.local_adam",
                       f"{cfg.model.name} on {cfg.data.name}, {args.workers} simulated workers, {args.local_steps} "
                       f"local AdamW steps, denominator {args.denominator} (refreshed every {refresh})",
                       time.time() - t0, body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
