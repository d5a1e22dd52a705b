"""Counting the kernels a piece of code launches, on any device (a CPU proxy for a GPU step).

    with Launches() as launches:
        hist = rs.compensate(...); rs.select(...)
    launches.triton      # ['_pass1', '_filter', ...]: each Triton kernel launched, in order
    launches.aten        # ['aten::fill_', ...]: each aten op that would launch a device kernel
    launches.total       # both

Two hooks see them, so a CPU test under Triton's interpreter (``TRITON_INTERPRET=1``) counts
what a step would launch on a GPU:

* the ``run`` of every ``@triton.jit`` function of the given modules (default: the kernels of
  every registered selection backend, ``core/select/registry.py:kernel_modules``), wrapped while
  counting, compiled or interpreted alike;
* a ``TorchDispatchMode`` for aten ops, where views, metadata and allocations (no kernel on
  any device) are left out. Ops the Triton interpreter makes itself are left out too.
"""
from __future__ import annotations

import sys

from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch nothing: allocations and metadata (views are known by their schema)
_NO_KERNEL = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
              "aten::new_empty_strided", "aten::lift_fresh", "aten::detach", "aten::alias",
              "aten::_local_scalar_dense", "aten::is_nonzero", "aten::sym_size", "aten::sym_stride",
              "aten::sym_numel", "aten::sym_storage_offset",
              # the optimizer's profiler ranges: bookkeeping on the host
              "profiler::_record_function_enter_new", "profiler::_record_function_exit"}


def _inside_triton() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton"):
            return True
        frame = frame.f_back
    return False


class _Aten(TorchDispatchMode):
    def __init__(self, names: list):
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not (func.is_view or name in _NO_KERNEL or _inside_triton()):
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def _kernels(modules) -> list:
    """The JIT functions (compiled or interpreted) defined in these modules."""
    found = {}
    for module in modules:
        for value in vars(module).values():
            if hasattr(value, "run") and hasattr(value, "fn") and callable(getattr(value, "__getitem__", None)):
                found[id(value)] = value     # a kernel imported by the other module is one kernel
    return list(found.values())


class Launches:
    """Context manager: ``triton`` and ``aten`` list the kernels launched inside it, in order."""

    def __init__(self, modules=None):
        if modules is None:
            from redsync_hvd.core.select import registry
            modules = registry.kernel_modules()
        self.triton: list = []
        self.aten: list = []
        self._kernels = _kernels(modules)
        self._mode = _Aten(self.aten)

    @property
    def total(self) -> int:
        return len(self.triton) + len(self.aten)

    def _wrap(self, kernel):
        run = kernel.run

        def counted(*args, **kwargs):
            self.triton.append(kernel.fn.__name__)
            return run(*args, **kwargs)
        kernel.run = counted

    def __enter__(self) -> "Launches":
        for kernel in self._kernels:
            self._wrap(kernel)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for kernel in self._kernels:
            del kernel.run          # the class's own run again
