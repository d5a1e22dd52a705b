"""Horovod's Gloo rendezvous server as a process of its own (run inside the switch namespace).

    ip netns exec <prefix>-sw python -m redsync_hvd.experiments.netbench.rendezvous --hosts 10.77.0.1:1,10.77.0.2:1

It does what ``horovodrun --gloo`` does before it ssh-es anywhere
(``horovod/runner/gloo_run.py: launch_gloo``): builds the slot plan with
``get_host_assignments(parse_hosts(hosts), np)``, starts a ``RendezvousServer`` on a free
port and ``init``s it with the plan. It prints ``PORT <n>`` once ready, then serves
until its stdin closes (the launcher exiting, crashing or killed) or SIGTERM.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading


def slot_plan(hosts: str, np: int | None = None):
    """Horovod's own slot assignment for ``hosts`` ("addr:slots,..."); np defaults to all slots."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    parsed = parse_hosts(hosts)
    return get_host_assignments(parsed, np or sum(h.slots for h in parsed))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hosts", required=True, help="addr:slots,addr:slots,...")
    ap.add_argument("--np", type=int, default=None)
    ap.add_argument("--verbose", type=int, default=0)
    a = ap.parse_args(argv)
    from horovod.runner.http.http_server import RendezvousServer
    server = RendezvousServer(a.verbose)
    port = server.start()
    server.init(slot_plan(a.hosts, a.np))
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())

    def watch_stdin():
        sys.stdin.read()      # EOF when the launcher goes away
        done.set()
    threading.Thread(target=watch_stdin, daemon=True).start()
    print(f"PORT {port}", flush=True)
    done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
