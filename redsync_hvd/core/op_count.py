"""Counting what a step asks of the device: aten ops dispatched and Triton kernels launched.

    with OpCount() as ops:
        exchange.submit(...); exchange.finish()
    ops.aten        # Counter: aten ops dispatched from redsync_hvd code, by name
    ops.launches    # Counter: Triton kernels launched, by name
    ops.kernels()   # what would launch device work on a GPU: aten ops that are not views or
                    # allocations, plus the Triton launches

On a GPU every launch costs the host a few microseconds, and a step that issues a hundred is
host-bound however fast its kernels are; so the count is a proxy for a GPU step's host time that
a CPU can check (tests/test_op_budget.py holds the exchange to a budget). Triton kernels are
counted on a GPU and in Triton's interpreter (``TRITON_INTERPRET=1``) alike; ops that the
interpreter itself dispatches while it runs a kernel on the host are not counted.
"""
from __future__ import annotations

import sys
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# metadata-only ops and allocations: host work, but no kernel on a GPU
FREE = {"aten::view", "aten::_reshape_alias", "aten::_unsafe_view", "aten::reshape", "aten::slice", "aten::select",
        "aten::as_strided", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose",
        "aten::permute", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::detach", "aten::alias",
        "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::lift_fresh", "aten::view_as",
        "aten::_to_copy_meta", "aten::set_", "aten::resize_"}


def _in_triton() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton"):
            return True
        frame = frame.f_back
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _in_triton():
            self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class OpCount:
    """Context manager: ``aten`` and ``launches`` count what ran inside it."""

    def __init__(self):
        self.aten: Counter = Counter()
        self.launches: Counter = Counter()
        self._mode = _Dispatch(self.aten)
        self._patched: list = []

    def __enter__(self) -> "OpCount":
        for cls in _jit_classes():
            run = cls.run
            self._patched.append((cls, run))
            cls.run = self._counting(run)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for cls, run in reversed(self._patched):
            cls.run = run
        self._patched.clear()

    def _counting(self, run):
        launches = self.launches

        def counted(fn, *args, **kwargs):
            if not kwargs.get("warmup", False):
                launches[getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")] += 1
            return run(fn, *args, **kwargs)
        return counted

    def kernels(self) -> int:
        """Device launches a GPU would make: aten ops that are not views or allocations, plus Triton's."""
        return sum(n for op, n in self.aten.items() if op not in FREE) + sum(self.launches.values())

    def views(self) -> int:
        """Metadata-only ops and allocations: host work without a kernel."""
        return sum(n for op, n in self.aten.items() if op in FREE)


def _jit_classes() -> list:
    """The Triton classes whose ``run`` launches a kernel (compiled, and interpreted)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:   # no Triton: only aten ops to count
        return []
    return [JITFunction, InterpretedFunction]
