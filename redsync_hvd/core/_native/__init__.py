"""Loader for the optional native selection kernel (see build.py).

`load()` returns the compiled module, or None when it is not built, was built for
another torch version, fails to import, or REDSYNC_NO_NATIVE=1 is set (`load_error`
then says which). It never compiles anything: building on the training hot path (on
every rank at once) is what the ahead-of-time build.py avoids.

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
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "_redsync_select"

_cached: Any = None
_tried = False
load_error: Optional[str] = None  # why load() returned None, for diagnostics


def torch_tag(version: str) -> str:
    return "torch_" + re.sub(r"[^0-9A-Za-z]+", "_", version)


def module_path(version: str) -> str:
    """Where build.py puts the module for this torch version."""
    return os.path.join(HERE, "%s.%s%s" % (NAME, torch_tag(version), importlib.machinery.EXTENSION_SUFFIXES[0]))


def load(force: bool = False) -> Any:
    """Return the native module or None (cached after the first call)."""
    global _cached, _tried, load_error
    if _tried and not force:
        return _cached
    _tried, _cached, load_error = True, None, None
    if os.environ.get("REDSYNC_NO_NATIVE", "0") not in ("", "0"):
        load_error = "disabled by REDSYNC_NO_NATIVE"
        return None
    try:
        import torch  # first: the module links libtorch/libc10 and the libgomp torch loads

        path = module_path(torch.__version__)
        if not os.path.exists(path):
            other = glob.glob(os.path.join(HERE, NAME + ".*"))
            load_error = ("built for another torch (%s), running %s: rebuild" % (
                ", ".join(sorted(os.path.basename(p) for p in other)), torch.__version__) if other
                else "not built (run python redsync_hvd/core/_native/build.py)")
            return None
        spec = importlib.util.spec_from_file_location(NAME, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _cached = mod
    except Exception as exc:  # a stale or broken build must not break training
        load_error = "%s: %s" % (type(exc).__name__, exc)
        _cached = None
    return _cached
