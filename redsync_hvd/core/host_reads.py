"""Counting the reads of tensor values by the host: on a GPU each one waits for the device.

    with HostReads() as reads:
        exchange.submit(...); exchange.finish()
    reads.events    # [(op, where)]: each read, and the innermost redsync_hvd function that made it

Two hooks see them, on any device (so CPU tests count what a GPU step would wait for):

* a ``TorchDispatchMode``: ops whose output size depends on values (nonzero, masked_select,
  boolean indexing, unique, repeat_interleave without ``output_size``), ``aten::equal`` and
  ``is_nonzero``, and copies of a CUDA tensor to the host;
* a ``TorchFunctionMode``: Python-level reads (``item``, ``tolist``, ``float()``, ``int()``,
  ``bool()``, ``__index__``, ``numpy``), which a CPU tensor makes without dispatching any op.

Reads made inside Triton (its interpreter, ``TRITON_INTERPRET=1``, runs kernels on the host
and reads their arguments there) are left out: on a GPU that is device work.
"""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SIZED_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
              "aten::_unique2", "aten::repeat_interleave", "aten::equal", "aten::is_nonzero"}
_PY_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"}


def _where() -> str:
    """'module:function' of the innermost redsync_hvd frame, '' inside Triton (not counted)."""
    frame = sys._getframe(1)
    found = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("triton"):
            return ""
        if found is None and module.startswith("redsync_hvd") and module != __name__:
            found = f"{module}:{frame.f_code.co_name}"
        frame = frame.f_back
    return found or "?"


class _Recorder:
    def __init__(self, events: list):
        self.events, self.quiet = events, False

    def __call__(self, op: str) -> None:
        if self.quiet:
            return
        where = _where()
        if where:
            self.events.append((op, where))


class _Dispatch(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        bool_index = name == "aten::index" and any(t is not None and t.dtype == torch.bool for t in args[1])
        sized = name == "aten::repeat_interleave" and kwargs.get("output_size") is not None
        to_host = name in ("aten::_to_copy", "aten::copy_") and any(
            isinstance(a, torch.Tensor) and a.is_cuda for a in args) and (
            kwargs.get("device") == torch.device("cpu") or (name == "aten::copy_" and not args[0].is_cuda))
        if (name in _SIZED_OPS and not sized) or bool_index or to_host:
            self.record(name)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not (name in _PY_READS and args and isinstance(args[0], torch.Tensor)):
            return func(*args, **(kwargs or {}))
        self.record(name)
        self.record.quiet = True   # the op it dispatches is the same read
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.record.quiet = False


class HostReads:
    """Context manager: ``events`` lists (op, where) for every read of a value by the host."""

    def __init__(self):
        self.events: list = []
        record = _Recorder(self.events)
        self._modes = (_Function(record), _Dispatch(record))

    def __enter__(self) -> "HostReads":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def where(self) -> list:
        return [w for _, w in self.events]
