"""Keep large CPU buffers in the heap from one step to the next (glibc malloc settings).

glibc serves every allocation above its mmap threshold (32 MB at most on 64-bit) with a
fresh ``mmap`` and gives it back to the kernel on ``free``. A gradient larger than that,
such as the 4096x4096 FC layer of the benchmark's VGG (67 MB), is then page-faulted in
anew by every backward pass: the kernel zeroes 16k pages before autograd writes them. On
the 2-core VM this was a third of that model's compute (one process, batch 16: a step of
159 ms fell to 125 ms, and system time from 6.2 to 1.0 s over the run). It is a property
of the allocator, not of any method: dense and compressed runs pay it alike. Intel's
PyTorch CPU tuning guide gives the same advice (use jemalloc or tcmalloc); these two
glibc settings get the effect without a new library:

* ``mmap_max=0``: never serve an allocation with its own mmap, so freed blocks stay in
  the heap for the next step's tensors of the same size;
* ``trim_threshold``: do not hand the freed top of the heap back to the kernel either.

The cost is that a process keeps its peak heap until it exits, as it would with a
caching allocator. ``env()`` is for processes yet to start (``GLIBC_TUNABLES`` is read
at start-up); ``apply_in_process()`` sets the same through ``mallopt`` for the current
one, for allocations made from then on.
"""
from __future__ import annotations

import ctypes
import ctypes.util

KEEP = 2**31 - 1     # mallopt takes an int: 2 GiB is "never trim" for these runs
TUNABLES = f"glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold={KEEP}"
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4   # from glibc's malloc.h


def env(current: dict | None = None) -> dict:
    """``{"GLIBC_TUNABLES": ...}`` for a child process, kept alongside any tunables already set."""
    prior = (current or {}).get("GLIBC_TUNABLES", "")
    return {"GLIBC_TUNABLES": f"{prior}:{TUNABLES}" if prior else TUNABLES}


def apply_in_process() -> bool:
    """The same settings for this process through ``mallopt``; False where libc has no mallopt
    (not glibc), in which case nothing changes."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEEP))
