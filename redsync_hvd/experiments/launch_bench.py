"""How long one ``horovodrun -np 2`` of an empty job takes, with horovodrun's build check answered
from the cache (``redsync_hvd/launch_patches.py``) and asked afresh
(``REDSYNC_BUILD_CHECK_CACHE=off``), the two interleaved over rounds; beside them ``mpirun`` alone,
the floor. Prints each one's median and range, and the ratio of the medians.

    .venv/bin/python -m redsync_hvd.experiments.launch_bench --rounds 10
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
JOB = [sys.executable, "-c", "import horovod.torch as hvd; hvd.init()"]
LAUNCHES = {
    "horovodrun, cached answers": ([str(BIN / "horovodrun"), "-np", "2", *JOB], {}),
    "horovodrun, asked afresh": ([str(BIN / "horovodrun"), "-np", "2", *JOB], {"REDSYNC_BUILD_CHECK_CACHE": "off"}),
    "mpirun alone": (["mpirun", "-np", "2", "--bind-to", "none", *JOB], {}),
}


def timed(cmd: list, extra: dict) -> float:
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **extra}
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    for cmd, extra in LAUNCHES.values():   # once untimed: the cache written, the files in the page cache
        timed(cmd, extra)
    times: dict = {name: [] for name in LAUNCHES}
    for _ in range(args.rounds):
        for name, (cmd, extra) in LAUNCHES.items():
            times[name].append(timed(cmd, extra))
    print(f"load average before the last round: {os.getloadavg()[0]:.2f}; {args.rounds} rounds")
    for name, got in times.items():
        print(f"{name:28s} median {statistics.median(got):.2f} s (range {min(got):.2f}-{max(got):.2f})")
    cached, fresh = (statistics.median(times[n]) for n in list(LAUNCHES)[:2])
    print(f"cached / asked afresh: {cached / fresh:.2f} ({fresh - cached:.2f} s less a launch)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
