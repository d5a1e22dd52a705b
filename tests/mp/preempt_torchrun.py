"""StopController over torch.distributed (gloo), under torchrun: a SIGTERM reaching rank 1 only
stops both ranks at the same step.

    torchrun --standalone --nproc-per-node 2 preempt_torchrun.py <signal step>
"""
import os
import signal
import sys

import torch
import torch.distributed as dist

from redsync_hvd.launchers import close_process_group
from redsync_hvd.preemption import EXIT_STOPPED, StopController, torch_distributed_max


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    signal_step = int(sys.argv[1])
    ctl = StopController(torch_distributed_max(), checkpoint_every_s=None).install()
    w = torch.zeros(4)
    for step in range(1, 1000):
        g = torch.full((4,), float(rank + 1))
        dist.all_reduce(g)                 # the training step's own collective
        w -= 0.01 * g
        if rank == 1 and step == signal_step:
            os.kill(os.getpid(), signal.SIGTERM)
        p = ctl.poll(step)
        if p.stop:
            ctl.barrier()
            print(f"rank {rank}: stopped at step {step} on {p.reason}", flush=True)
            close_process_group(EXIT_STOPPED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
