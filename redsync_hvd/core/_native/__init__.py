"""Loader for the optional native selection kernel (see build.py).

`find()` imports the compiled module, or raises where it is not built, was built for
another torch version, fails to import, or REDSYNC_NO_NATIVE=1 is set (the message says
which); ``core/select/native.py:load`` keeps what it found. It never compiles anything:
building on the training hot path (on every rank at once) is what the ahead-of-time build.py
avoids.

The torch version is part of the file name (``_redsync_select.<torch tag><ext suffix>``,
PyInit is looked up by module name, not file name), so a module built against another
torch is never loaded: its C++ ABI would not match.
"""
from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import re
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "_redsync_select"
KERNELS = 5   # select_kernels.cpp's version: raised where a function's arguments change


def torch_tag(version: str) -> str:
    return "torch_" + re.sub(r"[^0-9A-Za-z]+", "_", version)


def module_path(version: str) -> str:
    """Where build.py puts the module for this torch version."""
    return os.path.join(HERE, "%s.%s%s" % (NAME, torch_tag(version), importlib.machinery.EXTENSION_SUFFIXES[0]))


class NotLoaded(RuntimeError):
    """The module is not built, built for another torch, or turned off (the message says which)."""


def find() -> Any:
    """Import the module built for the running torch; raises :class:`NotLoaded` (or the import's
    own error) where it cannot. Callers keep the result: ``core/select/native.py:load``."""
    if os.environ.get("REDSYNC_NO_NATIVE", "0") not in ("", "0"):
        raise NotLoaded("disabled by REDSYNC_NO_NATIVE")
    import torch  # first: the module links libtorch/libc10 and the libgomp torch loads

    path = module_path(torch.__version__)
    if not os.path.exists(path):
        other = glob.glob(os.path.join(HERE, NAME + ".*"))
        raise NotLoaded("built for another torch (%s), running %s: rebuild" % (
            ", ".join(sorted(os.path.basename(p) for p in other)), torch.__version__) if other
            else "not built (run python redsync_hvd/core/_native/build.py)")
    spec = importlib.util.spec_from_file_location(NAME, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if getattr(mod, "KERNELS", 1) != KERNELS:   # its functions would take other arguments
        raise NotLoaded("built from an older select_kernels.cpp (rebuild: python redsync_hvd/core/_native/build.py)")
    return mod
