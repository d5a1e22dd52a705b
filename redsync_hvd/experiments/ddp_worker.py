"""A YAML config trained under DDP and ``torchrun``, for comparisons with the Horovod runner.

    torchrun --standalone --nproc_per_node 2 -m redsync_hvd.experiments.ddp_worker --config configs/digits/dense.yaml \
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
import sys

from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel

from ..config import ConfigError, load_config
from ..torch.training import DDPAdapter
from ..train import folder_problem, launch

HOOKS = ("none", "torch_powersgd", "ours")


class ByteCounter:
    """Wire and dense bytes of DDP's own reduction or of torch's PowerSGD hook, per worker."""

    def __init__(self):
        self.wire = self.dense = self.steps = 0

    def communication_stats(self) -> dict:
        ratio = self.dense / self.wire if self.wire else 1.0
        return {"wire_bytes": self.wire, "dense_bytes": self.dense, "compression_ratio": ratio,
                "steps": self.steps, "select": 0.0, "communicate": 0.0, "decompress": 0.0}   # not timed apart

    def set_steps_per_epoch(self, steps: int) -> None:
        pass   # the runner's interface: neither hook has a schedule

    def set_grad_scaler(self, scaler) -> None:
        pass   # neither hook keeps state that a skipped fp16 step must leave alone

    def layer_decisions(self) -> list:
        return []

    def state_dict(self) -> dict:
        return {"wire": self.wire, "dense": self.dense, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("redsync_hvd.experiments.ddp_worker does not resume torch's hooks; "
                                  "start the run again")


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


class CountedDDPAdapter(DDPAdapter):
    """The runner's ``engine: ddp`` start-up and trainer, with DDP's own reduction or torch's
    PowerSGD hook in place of ours: only ``distribute`` differs."""

    def __init__(self, args):
        super().__init__()
        self.args = args

    def distribute(self, cfg, model, opt, total: int | None = None) -> tuple:
        if self.args.hook == "ours":
            return super().distribute(cfg, model, opt, total)
        ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        counter = ByteCounter()
        a = self.args
        hook, state = (plain_hook(counter) if a.hook == "none" else
                       powersgd_hook(counter, a.powersgd_rank, a.powersgd_start, a.powersgd_seed))
        ddp.register_comm_hook(state, hook)
        return ddp, opt, counter


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
    """1. config (a bad one: exit code 2, as the runner); 2. the runner's launch with the adapter."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides + ["engine=ddp"])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = folder_problem(cfg)   # the runner's own check: no run folder holds two runs
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return launch(cfg, CountedDDPAdapter(args))


if __name__ == "__main__":
    sys.exit(main())
