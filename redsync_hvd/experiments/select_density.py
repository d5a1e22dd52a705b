"""The native index pass (``select_above``) against the share of a layer it emits.

    .venv/bin/python -m redsync_hvd.experiments.select_density
    .venv/bin/python -m redsync_hvd.experiments.select_density --numel 16777216 --densities 0.001,0.01,0.107

1. A unit Gaussian x of ``--numel`` elements (VGG-FC's FC layer by default), one torch thread.
2. For each density, the threshold that leaves that share of |x| above it.
3. ``--repeats`` calls of the pass, each after four tensors of 16 MB were allocated and freed (as a
   step's other tensors come and go), printing each call's milliseconds and their median; the
   first call page-faults its outputs in.

The exchange of local steps sends density x local steps (about 10%) of each layer: there nearly
every group of 32 elements holds a hit, which the pass's compaction must keep cheap
(``core/_native/select_kernels.cpp``, "select_above, AVX2 compaction").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..core import _native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=16_777_216)
    ap.add_argument("--densities", default="0.001,0.01,0.107")
    ap.add_argument("--repeats", type=int, default=6)
    a = ap.parse_args()
    mod = _native.find()
    torch.set_num_threads(1)                                                                    # 1.
    x = torch.randn(a.numel, generator=torch.Generator().manual_seed(0))
    for density in (float(d) for d in a.densities.split(",")):
        thr = float(x.abs().kthvalue(int(a.numel * (1 - density))).values)                      # 2.
        times = []
        for r in range(a.repeats):                                                              # 3.
            others = [torch.ones(4_000_000 + r) for _ in range(4)]
            del others
            t0 = time.perf_counter()
            idx, _, count, _ = mod.select_above(x, thr, a.numel, True, True, 0)
            times.append(1e3 * (time.perf_counter() - t0))
            del idx
        print(f"density {density:g}: {count} hits, ms " + " ".join(f"{t:.1f}" for t in times)
              + f", median {statistics.median(times):.1f}", flush=True)


if __name__ == "__main__":
    main()
