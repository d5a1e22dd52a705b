"""Replaying a bucket's device step from a CUDA graph: one launch instead of a few per step.

A compressed step issues a handful of kernels per bucket; on a GPU each launch costs the host
a few microseconds, which is most of the step when the kernels themselves take tens. A CUDA
graph (``torch.cuda.CUDAGraph``) records the kernels of one step once and replays them with
one launch, on the same memory. A step is valid to replay when everything it reads and writes
sits at the same addresses and its shapes are the same, which a key captures (a plan's layout,
its kept sign, which double buffers are current). So:

    1. ``off``, a CPU tensor, or fewer than ``warmup`` eager runs of this key: run eagerly (the
       first runs also compile the Triton kernels and build the layout's device tables, which a
       capture must not do);
    2. else capture the step into a new graph (its intermediate tensors live in the graph's own
       memory pool, so the output tensor is the same every replay), then replay it;
    3. a capture that CUDA refuses (an operation that cannot be captured) makes this bucket run
       eagerly from then on, and says so once (``auto``), or raises (``on``).

Graphs of different keys are kept (a residual's two buffers alternate, the sign alternates), up
to ``max_graphs`` per bucket; a plan whose layout keeps changing stays eager until it settles.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch

log = logging.getLogger("redsync_hvd.exchange")
MODES = ("auto", "on", "off")


class CapturedSteps:
    """The graphs of one CUDA bucket's device step, by key; see the module docstring. The bucket asks
    ``replay(key)`` (the output of a captured step, or None), and where none is captured yet,
    ``due(key)`` (capture now?) and ``capture(step_fn, args, key)``; else it runs the step eagerly."""

    def __init__(self, mode: str = "auto", warmup: int = 2, max_graphs: int = 16):
        if mode not in MODES:
            raise ValueError(f"cuda_graph={mode!r} is not one of {MODES}")
        self.mode, self.warmup, self.max_graphs = mode, warmup, max_graphs
        self.graphs: dict = {}
        self.seen: Counter = Counter()
        self.refused: str | None = None
        self.replays = 0

    def describe(self) -> str:
        if self.mode == "off":
            return "eager"
        if self.refused:
            return f"eager (CUDA graph capture refused: {self.refused})"
        return f"replayed from a CUDA graph ({len(self.graphs)} captured)" if self.graphs \
            else "eager (CUDA graph after warm-up)"

    def replay(self, key):
        """The output tensors of the graph of ``key``, replayed now; None where there is none."""
        entry = self.graphs.get(key)
        if entry is None:
            return None
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def due(self, key) -> bool:
        """1. whether the step of ``key`` has run eagerly ``warmup`` times and may be captured now."""
        if self.mode == "off" or self.refused or len(self.graphs) >= self.max_graphs:
            return False
        self.seen[key] += 1
        return self.seen[key] > self.warmup

    def capture(self, step_fn, args: tuple, key):
        """2. ``step_fn(*args)`` captured into a new graph, then replayed: its output; None where CUDA
        refused (3.: the bucket then runs eagerly from now on)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = step_fn(*args)
        except Exception as exc:   # noqa: BLE001 (any refusal: the step still has to run)
            if self.mode == "on":
                raise RuntimeError(f"compression.cuda_graph: on, but CUDA refused to capture the exchange's "
                                   f"step ({exc}); set cuda_graph: auto (runs eagerly then) or off") from exc
            self.refused = f"{type(exc).__name__}: {exc}"[:200]
            log.warning("a bucket's compressed step runs eagerly: CUDA graph capture refused (%s)", self.refused)
            torch.cuda.synchronize()
            return None
        self.graphs[key] = (graph, out)
        return self.replay(key)
