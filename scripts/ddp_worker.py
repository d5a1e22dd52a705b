#!/usr/bin/env python
"""A YAML config trained under DDP and ``torchrun``, for comparisons with the Horovod runner.

    torchrun --standalone --nproc_per_node 2 scripts/ddp_worker.py --config configs/digits/dense.yaml \
        --hook torch_powersgd --powersgd-rank 2 --powersgd-start 2 [--set training.seed=1 ...]

The same work as ``horovodrun -np 2 python -m redsync_hvd.train --config ...``: the loop is
redsync_hvd/runner.py itself (same shuffled order per rank from the same seeded generator,
same schedule, same evaluation, same run folder and summary.json); the data shard, the
seeded model and the optimizer come from the same builders in the same order. Only the
gradient reduction differs, by ``--hook``:

  1. ``none``: plain DDP (its own bucketed allreduce of the mean);
  2. ``torch_powersgd``: torch's ``powerSGD_hook`` (``PowerSGDState`` with the given rank
     and ``start_powerSGD_iter``; error feedback and warm start on, torch's defaults), each
     bucket's reduction waited for inside its hook (see ``powersgd_hook``);
  3. ``ours``: ``redsync_hvd.torch.ddp.register`` with the config's ``compression`` section.

Bytes (1 and 2) are counted per worker as the Horovod runner counts them: what this rank
hands to a collective. For torch's hook that is its own count of the numbers it allreduces
(``total_numel_after_compression``), or the whole bucket on its plain-allreduce steps.
With 2 workers, DDP's mean (each gradient divided by 2, then summed) equals Horovod's
(summed, then halved) bit for bit, so plain DDP and ``method: none`` under Horovod train
the same weights.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, default_collate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from redsync_hvd.config import ConfigError, load_config  # noqa: E402
from redsync_hvd.data import build_datasets  # noqa: E402
from redsync_hvd.models import build_model  # noqa: E402
from redsync_hvd.runner import lr_factor, run  # noqa: E402
from redsync_hvd.torch.training import build_optimizer, loss_and_correct  # noqa: E402

HOOKS = ("none", "torch_powersgd", "ours")


class ByteCounter:
    """Wire and dense bytes of DDP's own reduction or of torch's PowerSGD hook, per worker."""

    def __init__(self):
        self.wire = self.dense = self.steps = 0

    def stats(self) -> dict:
        ratio = self.dense / self.wire if self.wire else 1.0
        return {"wire_bytes": self.wire, "dense_bytes": self.dense, "compression_ratio": ratio,
                "steps": self.steps, "select": 0.0, "communicate": 0.0, "decompress": 0.0}   # not timed apart


def plain_hook(counter: ByteCounter):
    """DDP's default reduction (allreduce of the bucket divided by N), counted."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(group, bucket):
        buf = bucket.buffer()
        counter.wire += buf.numel() * buf.element_size()
        counter.dense += 4 * buf.numel()
        counter.steps += bucket.is_last()
        return default_hooks.allreduce_hook(group, bucket)
    return hook, None


def powersgd_hook(counter: ByteCounter, rank: int, start: int, seed: int):
    """torch's powerSGD_hook, counted with its own tally of the numbers it allreduces."""
    state = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                     start_powerSGD_iter=start, random_seed=seed)

    def hook(st, bucket):
        buf = bucket.buffer()
        before = st.total_numel_after_compression
        fut = torch_psgd.powerSGD_hook(st, bucket)
        # The hook starts P's and Q's allreduces from future callbacks, on whichever thread
        # finishes the previous one: with several buckets in flight the two ranks issued them in
        # different orders (Gloo: "Received data size doesn't match expected size"). Waiting here
        # keeps bucket order on every rank, at the cost of overlap with backward.
        fut.wait()
        sent = st.total_numel_after_compression - before
        counter.wire += 4 * (sent if sent else buf.numel())   # 0: a plain-allreduce step
        counter.dense += 4 * buf.numel()
        counter.steps += bucket.is_last()
        return fut
    return hook, state


class DDPTrainer:
    """runner.Trainer for a DDP model: the Horovod trainer's step and evaluation, DDP's reduction."""
    framework = "torch"

    def __init__(self, cfg, data, rank: int, size: int, args):
        self.cfg, self.data, self.rank, self.size = cfg, data, rank, size
        self.task, self.train_size = data.task, len(data.train)
        self.model = build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options)
        self.ddp = DDP(self.model)   # broadcasts rank 0's weights, as broadcast_parameters does
        self.opt = build_optimizer(cfg, self.model, size)
        self.counter, self.state = ByteCounter(), None
        if args.hook == "ours":
            from redsync_hvd.torch import ddp as rddp
            self.state = rddp.register(self.ddp, cfg.compression.model_dump(), optimizer=self.opt)
        else:
            hook, hstate = (plain_hook(self.counter) if args.hook == "none" else
                            powersgd_hook(self.counter, args.powersgd_rank, args.powersgd_start, args.powersgd_seed))
            self.ddp.register_comm_hook(hstate, hook)
        self.sched = None

    def set_steps_per_epoch(self, steps: int) -> None:
        if self.state is not None:
            self.state.set_steps_per_epoch(steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_factor(self.cfg, steps))

    def step(self, indices: torch.Tensor, step: int) -> tuple:
        ds = self.data.train
        idx = indices.tolist()
        x, y = default_collate(ds.__getitems__(idx) if hasattr(ds, "__getitems__") else [ds[i] for i in idx])
        loss, correct, n = loss_and_correct(self.ddp, x, y, self.task)
        self.opt.zero_grad()
        loss.backward()   # the hooks reduce inside backward
        self.opt.step()
        self.sched.step()
        return loss.item(), correct, n

    def lr(self, step: int) -> float:
        return self.sched.get_last_lr()[0]

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Each rank scores its slice of the test set; the sums are allreduced (as the Horovod trainer)."""
        self.model.eval()
        test = self.data.test
        loader = DataLoader(Subset(test, list(range(self.rank, len(test), self.size))),
                            batch_size=max(256, self.cfg.training.batch_size))
        tot = torch.zeros(3, dtype=torch.float64)
        for x, y in loader:
            loss, correct, n = loss_and_correct(self.model, x, y, self.task)
            tot += torch.tensor([loss.item() * n, correct, n], dtype=torch.float64)
        dist.all_reduce(tot)
        self.model.train()
        return {"test_loss": tot[0].item() / max(1, tot[2].item()),
                "test_accuracy": tot[1].item() / max(1, tot[2].item())}

    def state_dict(self) -> dict:
        out = {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}
        if self.state is not None:
            out["hook"] = self.state.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("scripts/ddp_worker.py does not resume; start the run again")

    def communication_stats(self) -> dict:
        return self.state.communication_stats() if self.state is not None else self.counter.stats()

    def layer_decisions(self) -> list:
        return self.state.layer_decisions() if self.state is not None else []


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--hook", choices=HOOKS, default="none")
    ap.add_argument("--powersgd-rank", type=int, default=2, help="torch_powersgd: matrix_approximation_rank")
    ap.add_argument("--powersgd-start", type=int, default=2,
                    help="torch_powersgd: start_powerSGD_iter (2 is the least torch allows with error feedback)")
    ap.add_argument("--powersgd-seed", type=int, default=0, help="torch_powersgd: random_seed of the first Q")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """1. config; 2. process group and threads (as the Horovod adapter sets them); 3. seed, data,
    trainer in the Horovod runner's order; 4. the runner's loop."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    torch.set_num_threads(cfg.training.threads or max(1, (os.cpu_count() or 1) // local))
    torch.manual_seed(cfg.training.seed)
    data = build_datasets(cfg.data.name, path=cfg.data.path, rank=rank, size=size, seed=cfg.training.seed,
                          **cfg.data.options)
    trainer = DDPTrainer(cfg, data, rank, size, args)
    code = run(cfg, trainer, rank, size)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
