"""netbench command line (run from the repository root, as root).

    python -m redsync_hvd.experiments.netbench check                      # root? iproute2? tbf? netem?
    python -m redsync_hvd.experiments.netbench probe --hosts 2 --bandwidth-mbit 1000 [--latency-ms 0]
    python -m redsync_hvd.experiments.netbench run --hosts 2 --bandwidth-mbit 1000 -- \\
        python -m redsync_hvd.train --config configs/digits/topk.yaml --set training.epochs=1
    python -m redsync_hvd.experiments.netbench mpi-allreduce --bandwidth-mbit 100 --mb 72 --repeats 5 \\
        [--mca coll_tuned_allreduce_algorithm=3 ...]                  # MPI's allreduce alone (mpi_probe.py)
    python -m redsync_hvd.experiments.netbench cleanup                    # delete leftover rsnb* namespaces

``run`` builds the network, starts the command once per host as one Horovod job
(Gloo, rendezvous in the switch namespace), prints each rank's log tail and tears
everything down, also on failure and Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys

from .netns import NetbenchUnavailable, ShapedNetwork, cleanup, missing_prerequisites, qdisc_available


def _terminate(signum, frame):   # SIGTERM/SIGHUP -> unwind through the context managers
    raise KeyboardInterrupt(f"signal {signum}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m redsync_hvd.experiments.netbench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="report whether the emulated network can be built here")
    sub.add_parser("cleanup", help="delete namespaces left by a crashed run (names rsnb*)")
    for name in ("probe", "run", "mpi-allreduce"):
        p = sub.add_parser(name)
        p.add_argument("--hosts", type=int, default=2)
        p.add_argument("--bandwidth-mbit", type=float, default=1000.0, help="0: unshaped")
        p.add_argument("--latency-ms", type=float, default=0.0, help="added one-way latency (needs netem)")
        p.add_argument("--verbose", action="store_true")
        if name == "run":
            p.add_argument("--timeout", type=float, default=600)
            p.add_argument("--log-dir", default=None)
            p.add_argument("command", nargs=argparse.REMAINDER, help="-- command run once per host")
        if name == "mpi-allreduce":
            p.add_argument("--mb", type=float, default=72.0, help="the buffer, MB of fp32")
            p.add_argument("--repeats", type=int, default=5)
            p.add_argument("--mca", action="append", default=[], metavar="K=V",
                           help="an Open MPI parameter for every rank (OMPI_MCA_K=V); repeat for more")
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    if a.cmd == "check":
        why = missing_prerequisites()
        if why:
            print("not available: " + "; ".join(why))
            return 1
        print(json.dumps({"root": True, "iproute2": True, "tbf": qdisc_available("tbf"),
                          "netem": qdisc_available("netem")}))
        return 0
    if a.cmd == "cleanup":
        gone = cleanup()
        print(f"deleted {len(gone)} namespace(s): {' '.join(gone)}" if gone else "nothing to delete")
        return 0

    bad = [kv for kv in getattr(a, "mca", []) if "=" not in kv]
    if bad:   # before the network is built
        print(f"--mca takes K=V (an Open MPI parameter and its value), got {bad}", file=sys.stderr)
        return 2
    bw = a.bandwidth_mbit or None
    try:
        with ShapedNetwork(hosts=a.hosts, bandwidth_mbit=bw, latency_ms=a.latency_ms, verbose=a.verbose) as net:
            print(f"network up: {net.describe()} ({net.prefix}-*)", file=sys.stderr)
            if a.cmd == "probe":
                from .probe import measure_link
                if a.hosts < 2:
                    print("probe needs --hosts >= 2", file=sys.stderr)
                    return 2
                print(net.qdiscs(), file=sys.stderr)
                size = 8 << 20 if (bw or 1e9) < 500 else 64 << 20
                print(json.dumps(measure_link(net, nbytes=size)))
                return 0
            if a.cmd == "mpi-allreduce":
                return _mpi_allreduce(net, a)
            from .launcher import LaunchError, launch
            cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
            if not cmd:
                print("run needs a command after --", file=sys.stderr)
                return 2
            try:
                results = launch(net, cmd, timeout=a.timeout, log_dir=a.log_dir, check=False)
            except LaunchError as exc:
                print(exc, file=sys.stderr)
                return 1
            for r in results:
                print(f"--- rank {r.rank} (host {r.host}, exit {r.returncode}); log {r.log}\n{r.tail(2000)}")
            return max((abs(r.returncode or 0) for r in results), default=0)
    except NetbenchUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: network torn down", file=sys.stderr)
        return 130


def _mpi_allreduce(net, a) -> int:
    from .launcher import LaunchError
    from .mpi_probe import allreduce_times
    try:
        result = allreduce_times(net, a.mb, a.repeats, dict(kv.split("=", 1) for kv in a.mca))
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
