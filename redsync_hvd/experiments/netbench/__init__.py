"""netbench: end-to-end training speed on an emulated, shaped network, on one Linux machine.

* ``netns.py``      hosts = network namespaces behind a bridge, links shaped with tc
                    (``ShapedNetwork`` context manager; ``cleanup`` for leftovers)
* ``launcher.py``   one Horovod/Gloo worker per host via ``ip netns exec``, rendezvous
                    server (``rendezvous.py``) in the switch namespace; no ssh, no horovodrun
* ``mpi_launcher.py`` one MPI rank per host: mpirun with an rsh agent that enters the
                    namespaces (DCD/ECD need mpi4py's world)
* ``probe.py``      TCP goodput and RTT of the shaped links
* ``worker.py``     bench worker: synthetic data, S steps, per-step time split (JSON)
* ``predict.py``    the cost model's prediction for a measured run
* ``report.py``     result rows (measured and predicted), CSV and markdown tables, plots
* ``__main__.py``   CLI: ``python -m redsync_hvd.experiments.netbench check|probe|run|cleanup``

Driven by ``scripts/bench_end_to_end.py --config configs/bench/quick.yaml``.
Needs root and iproute2 (``ip``, ``tc``); see ``netns.missing_prerequisites()``.
"""
from .netns import (
                    NetbenchUnavailable,
                    ShapedNetwork,
                    check_prerequisites,
                    cleanup,
                    list_namespaces,
                    missing_prerequisites,
                    netem_available,
)

__all__ = ["ShapedNetwork", "NetbenchUnavailable", "check_prerequisites", "missing_prerequisites",
           "cleanup", "list_namespaces", "netem_available"]
