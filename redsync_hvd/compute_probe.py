"""Measure what compression costs per element on this machine, for ``policy: cost_model``.

The cost model's default :class:`~redsync_hvd.costmodel.ComputeModel` holds rough CPU
figures; a shared 2-core VM or a GPU can be several times off, and then the policy
compresses layers where it does not pay. ``probe_compute`` times, on the training
device, the per-step work of a compressed layer that scales with its size: residual
compensation (r + g) plus a TBS selection at density 0.001, on a 4M-element tensor.
Ranks agree on the figure with one allreduce (the mean), so every rank takes the same
per-layer decisions: different decisions would give ranks different bucket layouts.
"""
from __future__ import annotations

import time

import torch

from .core.selection import select_topk
from .costmodel import ComputeModel


def probe_compute(comm, device="cpu", numel: int = 1 << 22, repeats: int = 5) -> ComputeModel:
    """A ComputeModel whose per-element selection cost was measured here (agreed by all ranks)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(numel, generator=gen).to(device)
    r = torch.randn(numel, generator=gen).to(device) * 0.1
    out = torch.empty_like(g)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for rep in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        torch.add(r, g, out=out)
        select_topk(out, numel // 1000, "tbs")
        sync()
        if rep:  # the first call warms caches and the allocator
            times.append(time.perf_counter() - t0)
    # the fastest repeat: what the machine does when this job has it (other jobs on a
    # shared host inflate the median at probe time, not necessarily later)
    mine = torch.tensor([min(times) / numel], dtype=torch.float64)
    if getattr(comm, "size", 1) > 1:
        mine = comm.wait(comm.allreduce_async(mine, name="costmodel.compute_probe", average=True))
    return ComputeModel(select_c1=float(mine[0]))
