"""The selection backends: each registered once, with what it applies to; :func:`pick` chooses.

    register(Backend("mine", strategies=("radix",), devices=("cuda",), load=lambda: MyKernels(), rank=5))

A backend runs some strategies (``contract.py``) in one of two forms, its ``unit``:

* ``"layer"``: passes over one segment's flat x (``stats``, ``count``, ``select``, ``sub``: see
  ``passes.py:TorchPasses``), which the searches of ``searches.py`` are written against once;
  ``load()`` returns a factory ``(flat, err, scan) -> passes``;
* ``"bucket"``: every segment of a layout at once; ``load()`` returns an object with
  ``select(seg, x, contract, ask) -> Selection`` (``radix.py:TorchRadix`` is the reference:
  also ``compensate`` and ``decode_add``, which a backend may leave to it).

:func:`pick` is the one place that chooses: an explicit name must apply (its strategies,
device and dtype) and load, else a ValueError says why; "auto" takes, of the backends that
apply and whose ``auto`` condition holds, the highest ``rank`` that loads. The config's
backend choices (``selection.radix_backend``) are validated against :func:`names`, and the
launch counter (``core/launches.py``) counts the JIT kernels of every backend's ``kernels``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


class Unavailable(RuntimeError):
    """Raised by a loader: the backend cannot run here (the message says why)."""


class Loader:
    """A backend's implementation, loaded on the first call and kept (``force``: try again).
    ``error`` says why the last load gave None; loading never raises."""

    def __init__(self, load: Callable[[], Any]):
        self._load, self.tried, self.value, self.error = load, False, None, None

    def __call__(self, force: bool = False) -> Any:
        if self.tried and not force:
            return self.value
        self.tried, self.value, self.error = True, None, None
        try:
            self.value = self._load()
        except Unavailable as e:
            self.error = str(e)
        except Exception as e:   # a broken build or an import failure must not break training
            self.error = "%s: %s" % (type(e).__name__, e)
        return self.value


def module(name: str, hint: str = "") -> Loader:
    """A loader that imports a module by name (``hint``: what to do where it does not import)."""
    def load():
        try:
            return importlib.import_module(name)
        except ImportError as e:
            raise Unavailable(f"{e}{hint}") from None
    return Loader(load)


class Gate:
    """A backend's ``load``: ``impl`` (else what ``loader`` loaded) once ``loader`` has loaded,
    None where it has not (``error`` says why). It asks ``loader`` each time, so a loader
    forced to load again (``REDSYNC_NO_NATIVE``) is followed."""

    def __init__(self, loader: Loader, impl: Any = None):
        self.loader, self.impl = loader, impl

    def __call__(self) -> Any:
        value = self.loader()
        return None if value is None else (self.impl if self.impl is not None else value)

    @property
    def error(self) -> Optional[str]:
        return self.loader.error


@dataclass(frozen=True)
class Target:
    """What is being selected from, as a backend's conditions see it."""
    strategy: str
    device: str          # the device type: "cpu", "cuda", ...
    dtype: torch.dtype
    numel: int = 0


@dataclass(frozen=True)
class Backend:
    """A backend and what it applies to.

    strategies: the strategies it runs; devices, dtypes: x's device types and dtypes (empty:
    any); load: a ``Loader`` (or any callable returning the implementation, or None with a reason
    in its ``error``); rank: auto's order (highest first); auto: a further condition for auto's
    choice (a size, determinism); refuse: a reason an explicit choice cannot run on a target
    its devices cover (the Triton interpreter off), or None; unit: "layer" or "bucket";
    exact_search: run a search as one exact top-k (the passes serve threshold reuse); kernels:
    modules of its JIT kernels, for the launch counter."""
    name: str
    strategies: tuple
    load: Callable[..., Any]
    devices: tuple = ()
    dtypes: tuple = ()
    rank: int = 0
    auto: Optional[Callable[[Target], bool]] = None
    refuse: Optional[Callable[[Target], Optional[str]]] = None
    unit: str = "layer"
    exact_search: bool = False
    kernels: tuple = ()

    def covers(self, t: Target) -> bool:
        return t.strategy in self.strategies and (not self.devices or t.device in self.devices) \
            and (not self.dtypes or t.dtype in self.dtypes)

    def needs(self) -> str:
        what = "/".join(d.upper() for d in self.devices) or "any"
        types = "/".join(str(d).replace("torch.", "") for d in self.dtypes)
        return f"needs a {what} {types + ' ' if types else ''}tensor"


_BACKENDS: list = []


def register(backend: Backend) -> Backend:
    """Add a backend (a later one of the same name and strategies replaces it); returns it."""
    _BACKENDS[:] = [b for b in _BACKENDS if not (b.name == backend.name and b.strategies == backend.strategies)]
    _BACKENDS.append(backend)
    _BACKENDS.sort(key=lambda b: -b.rank)   # stable: of equal ranks, the first registered first
    return backend


def unregister(name: str) -> None:
    _BACKENDS[:] = [b for b in _BACKENDS if b.name != name]


def backends(strategy: Optional[str] = None) -> list:
    """The registered backends (running ``strategy``), highest rank first."""
    return [b for b in _BACKENDS if strategy is None or strategy in b.strategies]


def names(strategy: str) -> tuple:
    """The choices for ``strategy``: "auto" and every backend that runs it."""
    return ("auto",) + tuple(dict.fromkeys(b.name for b in backends(strategy)))


def _loaded(backend: Backend) -> tuple:
    impl = backend.load()
    return impl, getattr(backend.load, "error", None) or "it did not load"


def pick(strategy: str, device, dtype: torch.dtype = torch.float32, numel: int = 0, choice: str = "auto",
         unit: Optional[str] = None) -> tuple:
    """(Backend, its implementation) for selecting with ``strategy`` from a tensor of this device
    type, dtype and size: ``choice`` by name, or "auto" (see the module docstring); ``unit``:
    only backends of that unit, and where none of them is preferred here (``auto``), the first
    that covers the tensor. Raises ValueError naming the choices, or why one cannot run."""
    t = Target(strategy, torch.device(device).type, dtype, numel)
    if choice != "auto":
        return _named(t, choice, unit)
    fits = [b for b in backends(strategy) if b.covers(t) and (unit is None or b.unit == unit)]
    # auto's conditions say where a backend is preferred; asked for a unit, one runs anyway
    for b in [b for b in fits if b.auto is None or b.auto(t)] + (fits if unit is not None else []):
        impl = b.load()
        if impl is not None:
            return b, impl
    raise ValueError(f"no selection backend runs {strategy!r} on a {t.device} {t.dtype} tensor"
                     + (f" a {unit} at a time" if unit else "") + f"; registered: {', '.join(names(strategy)[1:])}")


def _named(t: Target, choice: str, unit: Optional[str]) -> tuple:
    found = [b for b in backends(t.strategy) if b.name == choice]
    if not found:
        raise ValueError(f"backend={choice!r} is not one of {names(t.strategy)} (the backends registered for "
                         f"{t.strategy!r}: core/select/registry.py)")
    b = found[0]
    if not b.covers(t):
        raise ValueError(f"backend={choice!r} unavailable: {b.needs()}")
    why = b.refuse(t) if b.refuse is not None else None
    if why is not None:
        raise ValueError(f"backend={choice!r} unavailable: {why}")
    if unit is not None and b.unit != unit:
        raise ValueError(f"backend={choice!r} selects a {b.unit} at a time, not a {unit}")
    impl, why = _loaded(b)
    if impl is None:
        raise ValueError(f"backend={choice!r} unavailable: {why}")
    return b, impl


def check(strategy: str, choice: str) -> str:
    """``choice`` where a backend of that name runs ``strategy`` (or "auto"), else a ValueError
    naming the registered choices: what a config's backend field is validated by."""
    if choice not in names(strategy):
        raise ValueError(f"selection backend {choice!r} does not run {strategy!r}; registered: "
                         f"{', '.join(names(strategy))}")
    return choice


def kernel_modules() -> list:
    """The modules holding the JIT kernels of every registered backend that loads here."""
    out = []
    for b in _BACKENDS:
        for name in b.kernels:
            try:
                mod = importlib.import_module(name)
            except Exception:   # a backend that cannot load here launches nothing here
                continue
            if mod not in out:
                out.append(mod)
    return out
