"""A small training loop with the pieces a runner uses for preemption and resume.

    preempt_toy.py <run folder> <steps> [--signal-rank R --signal-step S] [--every-s T]
                   [--step-sleep SEC] [--resume]

Model: a 2-layer MLP; optimizer: redsync_hvd's DistributedOptimizer with top-k and residuals
(so a checkpoint holds per-worker state that must survive); data: drawn from (rank, step),
so a resumed run sees exactly the batches an uninterrupted one would. Every step each rank
calls StopController.poll; ``--signal-rank/--signal-step``: that rank sends itself SIGTERM
after that step (a scheduler's signal reaching one rank). At the end rank 0 prints
``final <sha256 of the weights>``.
"""
import argparse
import hashlib
import os
import signal
import sys
import time

import torch

import redsync_hvd.torch as rhvd
from redsync_hvd import checkpoint, launchers
from redsync_hvd.preemption import EXIT_STOPPED, StopController, exit_now, horovod_max


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("steps", type=int)
    ap.add_argument("--signal-rank", type=int, default=-1)
    ap.add_argument("--signal-step", type=int, default=-1)
    ap.add_argument("--every-s", type=float, default=600.0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 20, generator=g)
    return x, (x[:, :3].sum(1) > 0).long()


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def say(args, rank: int, text: str) -> None:
    """To stdout and to <run folder>/rank<r>.log (mpirun drops a rank's output when it aborts a job)."""
    print(f"rank {rank}: {text}", flush=True)
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, f"rank{rank}.log"), "a") as f:
        f.write(f"{time.time():.3f} {text}\n")


def main() -> int:
    args = parse()
    launchers.start_relay()   # before Horovod starts: mpirun's process group's signals reach this rank at once
    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    compression={"method": "topk", "density": 0.1, "policy": {"min_compress_numel": 0}})
    step = 0
    if args.resume:
        r = checkpoint.resume(args.run_dir, rank, size, lambda o: rhvd.allgather_object(o, name="resume"))
        model.load_state_dict(r.blob["model"])
        opt.load_state_dict(r.blob["optimizer"])
        step = r.agreement.step
        say(args, rank, f"resumed at step {step}")
    ctl = StopController(horovod_max(), checkpoint_every_s=args.every_s,
                         force_on_repeat=launchers.kind() is None).install()
    say(args, rank, f"training from step {step}")
    while step < args.steps:
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if rank == args.signal_rank and step == args.signal_step:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(args.step_sleep)
        p = ctl.poll(step)
        if p.save:
            blob = {"step": step, "world_size": size, "fingerprint": "toy", "model": model.state_dict(),
                    "optimizer": opt.state_dict()}
            checkpoint.save(args.run_dir, rank, blob)
            ctl.saved()
            say(args, rank, f"saved at step {step} ({p.reason})")
        if p.stop:
            ctl.barrier()
            say(args, rank, ctl.message(step, args.run_dir))
            return EXIT_STOPPED
    ctl.uninstall()
    if rank == 0:
        print(f"final {weights_hash(model)} at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if code == EXIT_STOPPED:
        exit_now(code)   # saved everywhere: end before the launcher's SIGKILL
    sys.exit(code)
