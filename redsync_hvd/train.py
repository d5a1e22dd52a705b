"""Train a model from a YAML config under horovodrun.

    horovodrun -np 2 python -m redsync_hvd.train --config configs/digits/topk.yaml \
        [--set compression.density=0.01 --set training.epochs=5 ...]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from .config import ConfigError, RunConfig, load_config
from .runlog import RunLog, rank_checkpoint


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m redsync_hvd.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML experiment file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value with its dotted name, e.g. compression.density=0.01")
    return ap.parse_args(argv)


def lr_lambda(cfg: RunConfig, steps_per_epoch: int):
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


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    if cfg.training.steps:
        return cfg.training.steps
    return max(1, int(round(cfg.training.epochs * steps_per_epoch)))


def loss_and_correct(model, x, y, task):
    out = model(x)
    if task == "lm":
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    loss = F.cross_entropy(out, y)
    return loss, (out.argmax(-1) == y).sum().item(), y.numel()


@torch.no_grad()
def evaluate(model, dataset, task, batch_size, rank, size, hvd):
    """Each rank scores its slice of the test set; sums are allreduced (counted apart from training bytes)."""
    model.eval()
    idx = list(range(rank, len(dataset), size))
    loader = DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=max(256, batch_size))
    tot = torch.zeros(3, dtype=torch.float64)
    for x, y in loader:
        loss, correct, n = loss_and_correct(model, x, y, task)
        tot += torch.tensor([loss.item() * n, correct, n], dtype=torch.float64)
    tot = hvd.allreduce(tot, op=hvd.Sum, name="rsync.eval")
    model.train()
    return {"test_loss": tot[0].item() / max(1, tot[2].item()), "test_accuracy": tot[1].item() / max(1, tot[2].item())}


def build_optimizer(cfg: RunConfig, model, size):
    o = cfg.optimizer
    lr = o.lr * (size if o.scale_lr_by_workers else 1)
    if o.name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=o.momentum, nesterov=o.nesterov,
                           weight_decay=o.weight_decay)


def print_layer_decisions(decisions) -> None:
    """The per-layer decision (compressed or dense, and why), printed once by rank 0."""
    for d in decisions:
        print(f"[layers] {d['name']}: {'compressed' if d['compressed'] else 'dense'} "
              f"(numel {d['numel']}, density {d['density']:g}; {d['why']})", file=sys.stderr)


def log_train_step(log: RunLog, stats: dict, step: int, steps_per_epoch: int, loss: float, train_accuracy: float,
                   lr: float) -> None:
    """One metrics.jsonl training line; ``stats`` is the optimizer's communication_stats() (consumed)."""
    last = stats.pop("last_step", {})
    stats.pop("layers", None)
    log.metrics({"step": step, "epoch": step / steps_per_epoch, "loss": loss, "train_accuracy": train_accuracy,
                 "lr": lr, "step_wire_bytes": last.get("wire_bytes", 0), **stats,
                 "last_step": {k: v for k, v in last.items() if k != "dense_bytes"}})


def eval_due(cfg: RunConfig, step: int, steps_per_epoch: int, total: int) -> bool:
    """Every ``training.eval_every`` steps, else at each epoch's end; always at the last step."""
    every = cfg.training.eval_every
    return bool((every and step % every == 0) or (not every and step % steps_per_epoch == 0) or step == total)


def build_summary(cfg: RunConfig, result: dict, stats: dict, decisions: list, step: int, size: int, wall: float,
                  t_eval: float, extra: dict | None = None) -> dict:
    """summary.json: final test figures, bytes, time per phase; ``stats`` is communication_stats() (consumed)."""
    stats.pop("last_step", None)
    layers = stats.pop("layers", {})
    phases = {p: stats.pop(p) for p in ("select", "communicate", "decompress")}
    return {
        "final_accuracy": result.get("test_accuracy"), "final_loss": result.get("test_loss"), **(extra or {}),
        "wire_bytes": stats["wire_bytes"], "dense_bytes": stats["dense_bytes"],
        "compression_ratio": stats["compression_ratio"], "steps": step, "workers": size,
        "wall_time_s": wall,
        "time_breakdown": {**phases, "eval": t_eval, "compute": max(0.0, wall - t_eval - sum(phases.values()))},
        "compression": cfg.compression.model_dump(mode="json"), "comm_detail": stats,
        "layers": layers, "layer_decisions": decisions,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # validate before any collective starts
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if cfg.framework == "tensorflow":
        try:
            from .tensorflow.train import run as run_tensorflow
        except ImportError as exc:   # a torch-only install: redsync_hvd.tensorflow's message names the fix
            print(f"error: framework: tensorflow: {exc}", file=sys.stderr)
            return 2
        return run_tensorflow(cfg)
    return run(cfg)


def run(cfg: RunConfig) -> int:
    import redsync_hvd.torch as rhvd
    from .data import build_datasets
    from .models import build_model

    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    # workers sharing a host split its cores; oversubscribed intra-op threads thrash
    torch.set_num_threads(cfg.training.threads or max(1, (os.cpu_count() or 1) // rhvd.local_size()))
    prints = rhvd.allgather_object(cfg.fingerprint(), name="rsync.cfg")
    if len(set(prints)) != 1:
        raise ConfigError(f"ranks loaded different configs (fingerprints {prints}); start every rank with the "
                          "same --config and --set arguments")
    torch.manual_seed(cfg.training.seed)
    try:
        data = build_datasets(cfg.data.name, path=cfg.data.path, rank=rank, size=size, seed=cfg.training.seed,
                              **cfg.data.options)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        print(f"error (rank {rank}): data: {exc}", file=sys.stderr)
        return 2
    model = build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options)
    base = build_optimizer(cfg, model, size)
    opt = rhvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=cfg.compression.model_dump())
    rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rhvd.broadcast_optimizer_state(opt, root_rank=0)

    gen = torch.Generator().manual_seed(cfg.training.seed * 1000 + rank)
    loader = DataLoader(data.train, batch_size=cfg.training.batch_size, shuffle=True, drop_last=True, generator=gen)
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        print(f"error: training.batch_size={cfg.training.batch_size} exceeds this rank's shard "
              f"({len(data.train)} samples); lower it", file=sys.stderr)
        return 2
    total = total_steps(cfg, steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, steps_per_epoch))
    opt.set_steps_per_epoch(steps_per_epoch)
    if rank == 0:
        print_layer_decisions(opt.layer_decisions())
    log = RunLog(cfg.output.dir, cfg.output.name or "run", rank)
    log.write_config(cfg.to_dict())

    step = 0
    if cfg.training.resume:
        ckpt = torch.load(rank_checkpoint(cfg.training.resume, rank), weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        gen.set_state(ckpt["generator"])
        step = ckpt["step"]

    def save(keep: bool = False):
        """Latest state per rank (residuals are per-worker); ``keep`` also leaves a per-step copy."""
        blob = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "generator": epoch_rng, "step": step, "config": cfg.to_dict()}
        torch.save(blob, log.checkpoint_path())
        if keep:
            torch.save(blob, log.dir / f"checkpoint-step{step}-rank{rank}.pt")

    bar = None
    if rank == 0 and cfg.training.progress:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=step, desc=cfg.output.name, unit="step", file=sys.stderr)
    t_start, t_eval, result, epoch_rng = time.perf_counter(), 0.0, {}, gen.get_state()
    # epochs restart the shuffled loader; on resume, skip the batches already seen in this epoch
    while step < total:
        skip = step % steps_per_epoch
        epoch_rng = gen.get_state()  # the loader draws this epoch's order from here; a resume replays it
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            loss, correct, n = loss_and_correct(model, x, y, data.task)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if step % cfg.training.log_every == 0 or step == total:
                log_train_step(log, opt.communication_stats(), step, steps_per_epoch, loss.item(), correct / n,
                               sched.get_last_lr()[0])
            if eval_due(cfg, step, steps_per_epoch, total):
                t0 = time.perf_counter()
                # decentralized workers hold different models: score their average
                averaged = opt.averaged_parameters() if hasattr(opt, "averaged_parameters") else nullcontext()
                with averaged:
                    result = evaluate(model, data.test, data.task, cfg.training.batch_size, rank, size, rhvd)
                if hasattr(opt, "consensus_distance"):
                    result["consensus_distance"] = opt.consensus_distance()
                t_eval += time.perf_counter() - t0
                log.metrics({"step": step, "epoch": step / steps_per_epoch, **result,
                             "wire_bytes": opt.communication_stats()["wire_bytes"]})
            if cfg.training.checkpoint_every and step % cfg.training.checkpoint_every == 0:
                save(keep=True)
            if step >= total:
                break
    if bar is not None:
        bar.close()
    save()
    wall = time.perf_counter() - t_start
    perplexity = {"final_perplexity": math.exp(min(result["test_loss"], 50))} if data.task == "lm" and result else {}
    summary = build_summary(cfg, result, opt.communication_stats(), opt.layer_decisions(), step, size, wall, t_eval,
                            extra=perplexity)
    log.summary(summary)
    log.close()
    if rank == 0:
        print(f"done: {log.dir} accuracy={summary['final_accuracy']:.4f} wire_bytes={summary['wire_bytes']} "
              f"ratio={summary['compression_ratio']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
