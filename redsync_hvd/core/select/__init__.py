"""One selection: ``select(seg, x, contract)`` for every layer of a bucket, by registered backends.

    sel = select(seg, x, Contract("tbs", threshold_reuse=5), state=states, first=scans)
    sel = select(seg, x, Contract("radix"), sign="pos", mean=True, first=hist, update=True)
    sel.positions, sel.counts, sel.values, sel.means, sel.nonfinite

``seg`` (``core/segments.py``) lays out x: one flat buffer, one k per segment (a single layer is
a segment of one: :func:`single`). The contract says how (``contract.py``: exactly k per segment,
or k to 2k by a threshold; the strategy, its options, the backend) and the result is one
:class:`Selection`. Where the work runs is the registry's choice (``registry.py``): per
segment, the searches of ``searches.py`` over a layer-at-a-time backend (native CPU, CuPy,
torch), or every segment at once by a bucket backend (``histogram`` for tbs; ``torch`` and
``triton`` for radix). A new backend is one file that calls :func:`register`.
"""
from __future__ import annotations

import functools
import os
from typing import Callable, Optional

import torch

from ..compensate import torch_compensate
from ..segments import Segments
from . import cupy_kernels, histogram, native, radix
from .contract import SEARCHES, Contract, NonFiniteError, Request, Selection, check_sign, nonfinite
from .passes import Compensated, Scan, ScanRequest, TorchPasses
from .radix import HistogramRequest
from .radix_ref import TorchRadix
from .registry import Backend, Gate, module, names, pick, register
from .searches import SelectionState, exact_signed, ranked, scan_request, search

__all__ = ["select", "select_topk", "single", "Contract", "Selection", "SelectionState", "NonFiniteError",
           "Backend", "register", "pick", "names", "scan_request", "ScanRequest", "Scan", "Compensated",
           "compensate", "HistogramRequest", "decode_add", "native_available", "ranked", "METHODS"]

METHODS = SEARCHES            # the per-layer strategies (``select_topk``'s methods)
_LAYERED = ("trimmed", "tbs", "sampled")
_TOPK_BELOW = 1 << 25   # CUDA: below this a search's launches and waits cost more than torch.topk


def native_available() -> bool:
    return native.available()


@functools.lru_cache(maxsize=4096)
def single(numel: int, k: int) -> Segments:
    """The layout of one layer of ``numel`` elements sending k: a segment of one."""
    return Segments([numel], [min(int(k), int(numel))])


def select(seg: Segments, x: torch.Tensor, contract: Contract, *, sign: Optional[str] = None,
           mean: bool = False, first=None, state=None, name: Optional[str] = None,
           index_dtype: Optional[torch.dtype] = None, value_dtype: torch.dtype = torch.float32,
           update: bool = False, velocity: Optional[torch.Tensor] = None) -> Selection:
    """About ``seg.ks[i]`` of the largest |x| of each segment of the flat ``x``, by ``contract``.

    sign, mean: the sign rule (``contract.py``) and one signed mean per segment instead of values
    (radix, exact, a bucket backend). first: the first pass the memory made while it computed x
    (a ``Scan``, or a list of one per segment; radix: ``compensate``'s histogram). state: the
    searches' ``SelectionState`` (or a list of one per segment). name: for the non-finite
    error. index_dtype, value_dtype: of positions and values. update, velocity: radix's error
    feedback in the same pass (x -= what receivers decode; the velocity zeroed there)."""
    check_sign(sign)
    if contract.strategy != "radix" and x.numel() != seg.n:   # radix checks its own, with the layout's padding
        raise ValueError(f"x: {x.numel()} elements for a layout of {seg.n}")
    ask = Request(sign, mean, first, state, name, index_dtype, value_dtype, update, velocity)
    if contract.strategy == "radix":
        return radix.select(seg, x, contract, ask)
    if contract.backend != "auto" and contract.strategy != "exact":
        b, impl = pick(contract.strategy, x.device, x.dtype, seg.n, contract.backend)
        if b.unit == "bucket":
            return impl.select(seg, x, contract, ask)
    return _by_segment(seg, x, contract, ask)


def compensate(residual: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, *,
               velocity: Optional[torch.Tensor] = None, velocity_out: Optional[torch.Tensor] = None,
               momentum: float = 0.0, nesterov: bool = False, step: Optional[Callable] = None, first=None,
               fuse: bool = True):
    """Error feedback's first step, out = residual + what this step adds, with the selection's first
    pass over out made in the same pass where a backend's kernel can; returns that pass (hand it to
    :func:`select` as ``first``), or None.

    1. What is added: grad (plain); with ``velocity`` DGC's velocity_out = momentum * velocity +
       grad, and velocity_out (or, nesterov, grad + momentum * velocity_out); or ``step``, a hook
       that writes out = residual + a worker's own optimizer step (``memory/adam.py``). The torch
       reference of all but the hook is ``core/compensate.py:torch_compensate``.
    2. The fused form, by ``first``: a :class:`HistogramRequest` (a bucket: the radix backend's
       ``compensate``, which makes the first histogram); else, with ``fuse``, the native CPU
       kernel for a layer (``native.py:compensate_scan``, the :class:`ScanRequest`'s scan, or
       statistics alone); the torch reference where neither runs."""
    if step is not None:                                                                        # 1.
        step(residual, grad, out)
        return None
    if isinstance(first, HistogramRequest):                                                     # 2.
        return radix.compensate(first.seg, residual, grad, out, velocity=velocity, velocity_out=velocity_out,
                                momentum=momentum, nesterov=nesterov, sign=first.sign, backend=first.contract.backend)
    scan = native.compensate_scan(residual, grad, out, first, velocity, velocity_out, momentum, nesterov, fuse=fuse)
    if scan is None:
        torch_compensate(residual, grad, out, velocity_in=velocity, velocity_out=velocity_out, momentum=momentum,
                         nesterov=nesterov)
    return scan if first is not None else None


def decode_add(seg: Segments, out: torch.Tensor, positions: torch.Tensor, values: Optional[torch.Tensor] = None, *,
               means: Optional[torch.Tensor] = None, alpha: float = 1.0, zero: Optional[torch.Tensor] = None,
               contract: Contract) -> None:
    """out += alpha * every rank's exactly-k message, in rank order (``radix.py:decode_add``)."""
    radix.decode_add(seg, out, positions, values, means=means, alpha=alpha, zero=zero, backend=contract.backend)


def _by_segment(seg: Segments, x: torch.Tensor, contract: Contract, ask: Request) -> Selection:
    """1. per segment, its search (or, exact with a sign, the k largest of a side); 2. one Selection."""
    if ask.update or ask.velocity is not None or (ask.mean and contract.strategy != "exact") \
            or (ask.sign is not None and contract.strategy != "exact"):
        raise ValueError(f"select: {contract.strategy!r} a segment at a time takes no update or velocity, and "
                         "a sign or a mean only with the exact strategy (apply the sign rule to its positions: "
                         "reference.py:keep_side)")
    one = len(seg) == 1
    if _uniform_exact(seg, contract, ask):
        return _exact_rows(seg, x, contract, ask)
    states = [ask.state] if one else (ask.state or [None] * len(seg))
    firsts = [ask.first] if one else (ask.first or [None] * len(seg))
    parts, means = [], []
    for v, k, s, f in zip(seg.views(x) if not one else [x], seg.ks, states, firsts):       # 1.
        if ask.sign is not None:
            idx, mu = exact_signed(v, k, ask.sign, ask.mean)
            means.append(mu)
        else:
            idx = search(v, k, contract, state=s, scan=f, name=ask.name)
        parts.append(idx if ask.index_dtype in (None, idx.dtype) else idx.to(ask.index_dtype))
    positions = parts[0] if one else torch.cat(parts)                                          # 2.
    return Selection(positions, tuple(p.numel() for p in parts), means=torch.cat(means) if ask.mean else None)


def _uniform_exact(seg: Segments, contract: Contract, ask: Request) -> bool:
    """Many segments of one size and one k, back to back, exact and unsigned (DCT blocks): one
    batched torch.topk over the rows instead of a call per segment. On the CPU its rows are the
    per-segment calls' answers in their order, ties included (tests/test_selection.py)."""
    return (contract.strategy == "exact" and ask.sign is None and ask.state is None and ask.first is None
            and len(seg) > 1 and not seg.padded and len(set(seg.sizes)) == 1 and len(set(seg.ks)) == 1
            and 0 < seg.ks[0] < seg.sizes[0])   # search() answers k = 0 and k >= n without torch.topk


def _exact_rows(seg: Segments, x: torch.Tensor, contract: Contract, ask: Request) -> Selection:
    rows = x.detach().reshape(len(seg), seg.sizes[0])
    if contract.finite and not bool(torch.isfinite(rows).all()):
        raise nonfinite(ask.name, x)
    pos = rows.abs().topk(seg.ks[0], dim=1, sorted=False).indices.reshape(-1)
    return Selection(pos if ask.index_dtype in (None, pos.dtype) else pos.to(ask.index_dtype), seg.ks)


def select_topk(x: torch.Tensor, k: int, method: str = "tbs", *, state: Optional[SelectionState] = None,
                scan: Optional[Scan] = None, name: Optional[str] = None, **options) -> torch.Tensor:
    """Indices (int64, x's device) of about the k largest |x| in ``x.flatten()``: :func:`select`
    over one layer, its positions. ``options``: the :class:`Contract`'s (``backend`` too)."""
    contract = Contract.of(method, **options)
    if contract.strategy not in METHODS:
        raise ValueError("unknown selection method %r; valid methods: %s" % (method, ", ".join(METHODS)))
    return search(x, k, contract, state=state, scan=scan, name=name)


# ---- the built-in backends (registry.py) --------------------------------------------------------
def _interpreter(t) -> Optional[str]:
    if t.device == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return None
    return ("on a CPU tensor it runs only in Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
            "imported, or pass CUDA tensors")


register(Backend("torch", _LAYERED, lambda: TorchPasses))
register(Backend("native", _LAYERED, Gate(native.load, native.passes), devices=("cpu",),
                 dtypes=(torch.float32, torch.float64), rank=2))
register(Backend("cuda", _LAYERED, Gate(cupy_kernels.load, cupy_kernels.passes), devices=("cuda",),
                 dtypes=(torch.float32,), rank=2))
register(Backend("topk", _LAYERED, lambda: TorchPasses, devices=("cuda",), rank=3, exact_search=True,
                 auto=lambda t: t.numel < _TOPK_BELOW))
register(Backend("histogram", ("tbs",), lambda: histogram, dtypes=(torch.float32,), rank=4, unit="bucket",
                 auto=lambda t: t.device == "cuda" and not torch.are_deterministic_algorithms_enabled()))
register(Backend("torch", ("radix",), lambda: TorchRadix, unit="bucket"))
register(Backend("triton", ("radix",), module("redsync_hvd.core.select.triton_select",
                                              ". Install it: pip install triton==3.9.0"),
                 devices=("cuda", "cpu"), rank=1, unit="bucket", auto=lambda t: t.device == "cuda",
                 refuse=_interpreter,
                 kernels=("redsync_hvd.core.select.triton_kernels", "redsync_hvd.core.select.triton_select")))

from . import native_radix  # noqa: E402,F401  (registers the CPU backend of radix: a file of its own)
