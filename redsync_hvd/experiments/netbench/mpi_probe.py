"""Open MPI's allreduce alone on the emulated link, with what the link dropped and TCP sent again.

    python -m redsync_hvd.experiments.netbench mpi-allreduce --bandwidth-mbit 100 --mb 72 --repeats 5 \\
        [--mca coll_tuned_use_dynamic_rules=1 --mca coll_tuned_allreduce_algorithm=3]

It tells apart the two reasons a dense step over MPI can miss the cost model: MPI's collective
(the same buffer with no Horovod and no model, beside the ring at the link's rate,
``costmodel.ring_allreduce``) or the link (packets the tbf queues dropped, segments TCP sent again,
counted in every namespace before and after). One rank per emulated host (``mpi_launcher.py``);
each allreduce of ``--mb`` MB of fp32 follows a barrier, and rank 0 prints its time. ``--mca k=v``
reaches every rank as ``OMPI_MCA_k=v``.
"""
from __future__ import annotations

import re
import sys
import time

from ...policy.costmodel import Network, ring_allreduce
from .mpi_launcher import launch_mpi
from .netns import HOST_IFACE

_TIME = re.compile(r"allreduce_s ([0-9.]+)")
_DROPS = re.compile(r"dropped (\d+)")
TCP_COUNTERS = ("TcpRetransSegs", "TcpOutSegs")


def link_counters(net) -> dict:
    """Packets dropped by every shaped qdisc (both ends of each host's link) and the hosts' TCP
    counters, summed over the hosts."""
    drops, tcp = 0, dict.fromkeys(TCP_COUNTERS, 0)
    for i in range(net.hosts):
        for ns, dev in ((i, HOST_IFACE), (None, f"h{i}")):
            shown = net.run_in(ns, ["tc", "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True)
            drops += sum(int(d) for d in _DROPS.findall(shown.stdout))
        shown = net.run_in(i, ["nstat", "-az", *TCP_COUNTERS], capture_output=True, text=True)
        for line in shown.stdout.splitlines():
            name, *rest = line.split()
            if name in tcp and rest:
                tcp[name] += int(rest[0])
    return {"dropped": drops, **tcp}


def allreduce_times(net, mb: float, repeats: int, mca: dict, log_dir=None, timeout: float = 900) -> dict:
    """Time ``repeats`` MPI allreduces of ``mb`` MB across ``net``'s hosts; the link's counters
    over them, and the ring at the shaped rate for comparison."""
    n = int(mb * 1e6) // 4
    before = link_counters(net)
    env = {f"OMPI_MCA_{k}": v for k, v in mca.items()}
    results = launch_mpi(net, ["python", "-m", __name__, str(n), str(repeats)], timeout=timeout,
                         log_dir=log_dir, env=env)
    times = [float(t) for t in _TIME.findall(results[0].log.read_text())]
    after = link_counters(net)
    bandwidth = (net.bandwidth_mbit or 0) * 1e6 / 8
    ring = ring_allreduce(net.hosts, 4 * n, Network(alpha=0.0, bandwidth=bandwidth)) if bandwidth else None
    return {"hosts": net.hosts, "bytes": 4 * n, "mca": mca, "times_s": times, "ring_at_link_rate_s": ring,
            **{k: after[k] - before[k] for k in after}}


def _rank_side(n: int, repeats: int) -> None:
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    x = np.random.default_rng(comm.rank).random(n, dtype=np.float32)
    y = np.empty_like(x)
    for _ in range(repeats):
        comm.Barrier()
        t = time.perf_counter()
        comm.Allreduce(x, y)
        if comm.rank == 0:
            print(f"allreduce_s {time.perf_counter() - t:.4f}", flush=True)


if __name__ == "__main__":
    _rank_side(int(sys.argv[1]), int(sys.argv[2]))
