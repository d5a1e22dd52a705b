"""Cost of StopController.poll: one allreduce (max) of four numbers per call.

    horovodrun -np 2 -H localhost:2 python scripts/bench_poll.py [calls]
    horovodrun --gloo -np 2 -H localhost:2 python scripts/bench_poll.py [calls]

Rank 0 prints the mean time per poll and the machine's load average.
"""
import os
import sys
import time

import horovod.torch as hvd

from redsync_hvd.preemption import StopController, horovod_max


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    hvd.init()
    ctl = StopController(horovod_max(), checkpoint_every_s=600)
    for step in range(20):   # warm-up: Horovod's first cycles negotiate the tensor
        ctl.poll(step)
    t0 = time.perf_counter()
    for step in range(calls):
        ctl.poll(step)
    per_call = (time.perf_counter() - t0) / calls
    if hvd.rank() == 0:
        print(f"poll: {per_call * 1e3:.2f} ms per call ({calls} calls, {hvd.size()} ranks, "
              f"{'gloo' if hvd.gloo_enabled() else 'mpi'}; {os.cpu_count()} cores, "
              f"load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
