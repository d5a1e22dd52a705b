"""Means and medians of measurements, and timing of calls on a CPU or a GPU."""
from __future__ import annotations

import statistics
import time


def mean(xs):
    """The mean of the values that are not None; None if there are none."""
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def median(xs):
    """The median of the values that are not None; None if there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def sync(device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU, where calls return when done."""
    if str(device).startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def timed_ms(fn, repeats: int, device="cpu", warmup: int = 1) -> tuple:
    """(median ms, best ms) of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones, each
    call waited for on the device."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def graphed(fn):
    """``fn``'s launches captured once in a CUDA graph (after two warm-up calls on a side stream,
    which compile and allocate); returns the replay."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
