"""Loader for the optional native selection kernel (see build.py).

`load()` returns the compiled module, or None when it is not built, was built
for another torch version, fails to import, or REDSYNC_NO_NATIVE=1 is set.
It never compiles anything: building on the training hot path (and on every
rank at once) is what ahead-of-time build.py avoids.
"""
from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import json
import os
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "_redsync_select"

_cached: Any = None
_tried = False
load_error: Optional[str] = None  # why load() returned None, for diagnostics


def _find() -> Optional[str]:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        hits = glob.glob(os.path.join(HERE, NAME + suffix))
        if hits:
            return hits[0]
    return None


def load(force: bool = False) -> Any:
    """Return the native module or None (cached after the first call)."""
    global _cached, _tried, load_error
    if _tried and not force:
        return _cached
    _tried, _cached, load_error = True, None, None
    if os.environ.get("REDSYNC_NO_NATIVE", "0") not in ("", "0"):
        load_error = "disabled by REDSYNC_NO_NATIVE"
        return None
    path = _find()
    if path is None:
        load_error = "not built (run python redsync_hvd/core/_native/build.py)"
        return None
    try:
        import torch  # must be loaded first: the module links libtorch/libc10 and libgomp

        with open(os.path.join(HERE, "_build_info.json")) as f:
            built_for = json.load(f).get("torch")
        if built_for != torch.__version__:
            load_error = "built for torch %s, running %s: rebuild" % (built_for, torch.__version__)
            return None
        spec = importlib.util.spec_from_file_location(NAME, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _cached = mod
    except Exception as exc:  # a stale or broken build must not break training
        load_error = "%s: %s" % (type(exc).__name__, exc)
        _cached = None
    return _cached
