"""One training loop for every framework and engine (``python -m redsync_hvd.train``).

A framework adapter supplies a :class:`Trainer`: one training step on a batch of sample
indices, an evaluation, its state, and its communication figures. The loop is written once:

    1. resume: every rank loads its own checkpoint (residuals are per worker)
    2. per epoch: the shuffled order of this rank's shard (a seeded generator, replayed on resume)
    3. per step: trainer.step(indices); a metrics.jsonl line every log_every steps
    4. evaluation every eval_every steps (else each epoch's end) and at the last step
    5. checkpoints every checkpoint_every steps and at the end; summary.json
"""
from __future__ import annotations

import math
import sys
import time
from typing import Protocol

import torch
from torch.utils.data import DataLoader

from .config import RunConfig
from .runlog import RunLog, load_checkpoint, rank_checkpoint, save_checkpoint


class Trainer(Protocol):
    framework: str
    task: str                       # "classification" | "lm"
    train_size: int                 # samples in this rank's shard

    def step(self, indices: torch.Tensor, step: int) -> tuple:
        """One training step on these sample indices: (loss, correct, count)."""

    def evaluate(self) -> dict:
        """Test figures summed over all ranks: test_loss, test_accuracy (and extras)."""

    def lr(self, step: int) -> float: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def communication_stats(self) -> dict: ...
    def layer_decisions(self) -> list: ...
    def set_steps_per_epoch(self, steps: int) -> None: ...


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    if cfg.training.steps:
        return cfg.training.steps
    return max(1, int(round(cfg.training.epochs * steps_per_epoch)))


def lr_factor(cfg: RunConfig, steps_per_epoch: int):
    """step -> factor of the base learning rate: linear warm-up, then step or cosine decay."""
    sched = cfg.optimizer.schedule
    total = total_steps(cfg, steps_per_epoch)

    def factor(step: int) -> float:
        epoch = step / max(1, steps_per_epoch)
        f = 1.0
        if sched.warmup_epochs and epoch < sched.warmup_epochs:
            f *= (step + 1) / (sched.warmup_epochs * steps_per_epoch)
        if sched.type == "step":
            f *= sched.gamma ** sum(epoch >= m for m in sched.milestones)
        elif sched.type == "cosine":
            f *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total))))
        return f
    return factor


def eval_due(cfg: RunConfig, step: int, steps_per_epoch: int, total: int) -> bool:
    """Every ``training.eval_every`` steps, else at each epoch's end; always at the last step."""
    every = cfg.training.eval_every
    return bool((every and step % every == 0) or (not every and step % steps_per_epoch == 0) or step == total)


class Run:
    """The loop's state: where it is, what it has measured, and its run folder."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, rank: int, size: int):
        self.cfg, self.trainer, self.rank, self.size = cfg, trainer, rank, size
        self.gen = torch.Generator().manual_seed(cfg.training.seed * 1000 + rank)
        self.loader = DataLoader(range(trainer.train_size), batch_size=cfg.training.batch_size, shuffle=True,
                                 drop_last=True, generator=self.gen)
        self.steps_per_epoch = len(self.loader)
        self.step, self.t_eval, self.result = 0, 0.0, {}
        self.epoch_rng = self.gen.get_state()
        self.log = None

    def start(self) -> None:
        cfg = self.cfg
        self.total = total_steps(cfg, self.steps_per_epoch)
        self.trainer.set_steps_per_epoch(self.steps_per_epoch)
        self.log = RunLog(cfg.output.dir, cfg.output.name or "run", self.rank)
        if self.rank == 0:
            write_layer_decisions(self.trainer.layer_decisions(), self.log.dir / "layers.log")
        self.log.write_config(cfg.to_dict())
        if cfg.training.resume:                                                     # 1.
            blob = load_checkpoint(rank_checkpoint(cfg.training.resume, self.rank))
            if blob.get("framework", "torch") != self.trainer.framework:
                raise ValueError(f"training.resume points at a {blob.get('framework', 'torch')} checkpoint; resume "
                                 f"a framework: {self.trainer.framework} run")
            self.trainer.load_state_dict(blob)
            self.gen.set_state(blob["generator"])
            self.step = blob["step"]

    def save(self, keep: bool = False) -> None:
        """Latest state per rank (residuals are per worker); ``keep`` also leaves a per-step copy."""
        blob = {"framework": self.trainer.framework, "step": self.step, "generator": self.epoch_rng,
                "config": self.cfg.to_dict(), **self.trainer.state_dict()}
        save_checkpoint(self.log.checkpoint_path(), blob)
        if keep:
            save_checkpoint(self.log.dir / f"checkpoint-step{self.step}-rank{self.rank}.pt", blob)

    def train(self) -> None:
        bar = progress_bar(self)
        t_start = time.perf_counter()
        while self.step < self.total:
            skip = self.step % self.steps_per_epoch
            self.epoch_rng = self.gen.get_state()   # the loader draws this epoch's order from here   # 2.
            for i, indices in enumerate(self.loader):
                if i < skip:
                    continue   # resumed mid-epoch: these batches were seen
                self._one_step(indices, bar)
                if self.step >= self.total:
                    break
        if bar is not None:
            bar.close()
        self.save()
        self.wall = time.perf_counter() - t_start

    def _one_step(self, indices, bar) -> None:
        loss, correct, n = self.trainer.step(indices, self.step)                   # 3.
        self.step += 1
        cfg, step = self.cfg, self.step
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if step % cfg.training.log_every == 0 or step == self.total:
            self._log_train(loss, correct / n)
        if eval_due(cfg, step, self.steps_per_epoch, self.total):                 # 4.
            t0 = time.perf_counter()
            self.result = self.trainer.evaluate()
            self.t_eval += time.perf_counter() - t0
            self.log.metrics({"step": step, "epoch": step / self.steps_per_epoch, **self.result,
                              "wire_bytes": self.trainer.communication_stats()["wire_bytes"]})
        if cfg.training.checkpoint_every and step % cfg.training.checkpoint_every == 0:   # 5.
            self.save(keep=True)

    def _log_train(self, loss: float, train_accuracy: float) -> None:
        stats = self.trainer.communication_stats()
        last = stats.pop("last_step", {})
        stats.pop("layers", None)
        self.log.metrics({"step": self.step, "epoch": self.step / self.steps_per_epoch, "loss": loss,
                          "train_accuracy": train_accuracy, "lr": self.trainer.lr(self.step),
                          "step_wire_bytes": last.get("wire_bytes", 0), **stats,
                          "last_step": {k: v for k, v in last.items() if k != "dense_bytes"}})

    def finish(self) -> dict:
        summary = build_summary(self)
        self.log.summary(summary)
        self.log.close()
        if self.rank == 0:
            suffix = "" if self.trainer.framework == "torch" else f" (framework {self.trainer.framework})"
            print(f"done: {self.log.dir} accuracy={summary['final_accuracy']:.4f} wire_bytes={summary['wire_bytes']} "
                  f"ratio={summary['compression_ratio']:.1f}{suffix}")
        return summary


def run(cfg: RunConfig, trainer: Trainer, rank: int, size: int) -> int:
    """Train to the end; 2 (after a clear message) when the shard is smaller than one batch."""
    loop = Run(cfg, trainer, rank, size)
    if loop.steps_per_epoch == 0:
        print(f"error: training.batch_size={cfg.training.batch_size} exceeds this rank's shard "
              f"({trainer.train_size} samples); lower it", file=sys.stderr)
        return 2
    loop.start()
    loop.train()
    loop.finish()
    return 0


def write_layer_decisions(decisions, path) -> None:
    """The per-layer decision (compressed or dense, and why), written once by rank 0 to the run
    folder's layers.log (summary.json has them too), not to the terminal."""
    with open(path, "w") as f:
        for d in decisions:
            print(f"[layers] {d['name']}: {'compressed' if d['compressed'] else 'dense'} "
                  f"(numel {d['numel']}, density {d['density']:g}; {d['why']})", file=f)


def progress_bar(loop: Run):
    if loop.rank != 0 or not loop.cfg.training.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=loop.total, initial=loop.step, desc=loop.cfg.output.name, unit="step", file=sys.stderr)


def build_summary(loop: Run) -> dict:
    """summary.json: final test figures, bytes, time per phase, per-layer figures and decisions."""
    stats = loop.trainer.communication_stats()
    stats.pop("last_step", None)
    layers = stats.pop("layers", {})
    phases = {p: stats.pop(p) for p in ("select", "communicate", "decompress")}
    result = loop.result
    extra = {"final_perplexity": math.exp(min(result["test_loss"], 50))} if loop.trainer.task == "lm" and result \
        else {}
    return {
        "final_accuracy": result.get("test_accuracy"), "final_loss": result.get("test_loss"), **extra,
        "wire_bytes": stats["wire_bytes"], "dense_bytes": stats["dense_bytes"],
        "compression_ratio": stats["compression_ratio"], "steps": loop.step, "workers": loop.size,
        "wall_time_s": loop.wall,
        "time_breakdown": {**phases, "eval": loop.t_eval,
                           "compute": max(0.0, loop.wall - loop.t_eval - sum(phases.values()))},
        "compression": loop.cfg.compression.model_dump(mode="json"), "comm_detail": stats,
        "layers": layers, "layer_decisions": loop.trainer.layer_decisions(),
    }
