"""Exactly k per layer of a bucket, chosen on the device by a radix select: no host wait.

RedSync's threshold binary search (Fang et al., 2019) probes one threshold per pass and
reads each count back to the host. Here each pass tests every threshold of a digit at once
(a histogram), the interval is narrowed on the device, and the result has exactly k
positions, so message sizes are known on the host before the step (the shape of AIR top-k,
Zhang et al., SC'23). For every layer (``Segments``: one flat fp32 buffer, one k per layer):

    key  = float32 bits of |x| (sign=None), or of x on its kept side (below): a non-negative
           float orders like its bit pattern; NaN/Inf sit at the top (bits >= 0x7F800000)
    need = k, prefix = 0
    for (shift, bins) in (23, 256), (11, 4096), (0, 2048):    # 8 + 12 + 11 = 31 bits
        h    = histogram of (key >> shift) & (bins-1) over keys whose higher bits == prefix
        b    = largest bin with sum(h[b:]) >= need             # on the device
        need = need - sum(h[b+1:]);  prefix |= b << shift
    T    = prefix                                              # the k-th largest key, exactly
    take = key > T, and the first `need` keys == T in position order   (exactly k, ties by position)
    out  = positions of take, ascending; values x there; or one mean of x there (sign_mean)

Sign-restricted selection ("pos"/"neg": RedSync's alternating sign_mean) ranks key =
x on the kept side and 0 elsewhere, so it returns the k largest of that sign (topped up
with the first elements of key 0 if the layer has fewer than k of them); "larger" (SBC,
Sattler et al., 2019) selects both sides and keeps, per layer, the side whose mean over its
k is larger in magnitude. The first histogram splits by sign, so all four modes share it.

Stages, each one launch for the whole bucket (the ``triton`` backend, ``triton_select.py``), or
the same steps in plain torch ops that run on any device (the ``torch`` backend,
``radix_ref.py``: the reference the kernels are tested against):

    first = compensate(seg, r, g, out, ...)        # out = r + g (DGC momentum too) + histogram 1
    sel = select(seg, out, RADIX, first=first, update=True, ...)   # the entry point (``__init__.py``):
                                             # levels 2-3, compaction, means, out[sent] -= what is sent
    decode_add(seg, avg, pos, vals, ...)     # gathered messages of N ranks, in rank order

A radix backend (``registry.py``) offers ``select``, and may offer ``compensate`` and
``decode_add`` (those of ``radix_ref.py:TorchRadix`` serve where it does not).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..segments import BINS, Segments, to_device
from .contract import Selection, check_sign
from .radix_ref import TorchRadix
from .registry import pick

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class HistogramRequest:
    """What a bucket's radix select wants from the pass that computes x (``compensate(first=...)``):
    the first histogram of the layout's layers, split by the sign rule's rows, made by the
    contract's backend."""
    seg: Segments
    sign: str | None
    contract: object


def sides(sign: str | None) -> tuple[int, tuple[int, ...]]:
    """(rows per layer R, the rows selected from): sign=None ranks |x| in one row; a sign
    splits each layer into a positive row 0 and a negative row 1."""
    check_sign(sign)
    return {None: (1, (0,)), "pos": (2, (0,)), "neg": (2, (1,)), "larger": (2, (0, 1))}[sign]


def k_rows(seg: Segments, device, sign: str | None) -> torch.Tensor:
    """(L*R,) int32: k for every (layer, row) selected from, 0 for a row not selected from."""
    R, active = sides(sign)
    return seg.derived(f"k_rows:{sign}", device, lambda: to_device(torch.tensor(
        [k if r in active else 0 for k in seg.ks for r in range(R)], dtype=torch.int32), device))


def kernels(backend: str, t: torch.Tensor):
    """The radix backend's implementation for this tensor (``registry.py:pick``)."""
    return pick("radix", t.device, t.dtype, t.numel(), backend)[1]


def _step(impl, name: str):
    """The backend's ``name`` step, or the torch reference's where it offers none."""
    return getattr(impl, name, None) or getattr(TorchRadix, name)


def _check(name: str, t: torch.Tensor | None, numel: int, dtypes=(torch.float32,)) -> None:
    if t is None:
        return
    if t.dim() != 1 or t.numel() != numel or t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{name}: need a contiguous 1-D tensor of {numel} elements of dtype "
                         f"{'/'.join(str(d) for d in dtypes)}, got {tuple(t.shape)} {t.dtype}")


def compensate(seg: Segments, residual: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, *,
               velocity: torch.Tensor | None = None, velocity_out: torch.Tensor | None = None,
               momentum: float = 0.0, nesterov: bool = False, sign: str | None = None,
               backend: str = "auto"):
    """out = residual + grad, fused with the radix select's first pass over out (hand it to
    ``select`` as ``first``).

    With ``velocity`` (DGC momentum correction): velocity_out = grad + momentum * velocity,
    out = residual + velocity_out, or residual + (grad + momentum * velocity_out) with
    ``nesterov``. grad may be fp16/bf16; everything else is fp32. ``out`` may be
    ``residual`` and ``velocity_out`` may be ``velocity`` (in place). The built-in backends
    return the (L*R, 256) int32 histogram of the exponents for ``sign``'s rows.
    """
    R, _ = sides(sign)
    for name, t, dt in (("residual", residual, (torch.float32,)), ("grad", grad, _GRAD_DTYPES),
                        ("out", out, (torch.float32,)), ("velocity", velocity, (torch.float32,)),
                        ("velocity_out", velocity_out, (torch.float32,))):
        _check(name, t, seg.n, dt)
    if (velocity is None) != (velocity_out is None):
        raise ValueError("compensate: pass velocity and velocity_out together (or neither)")
    return _step(kernels(backend, out), "compensate")(seg, out, R, residual, grad, velocity, velocity_out,
                                                      float(momentum), nesterov)


def select(seg: Segments, x: torch.Tensor, contract, ask) -> Selection:
    """Exactly ``seg.ks[i]`` elements of each layer of the flat float32 ``x`` (the order is in
    the module docstring). No host wait; output sizes come from ``seg``; NaN/Inf set
    ``nonfinite`` and raise nothing.

    ask.sign: None (rank |x|), "pos"/"neg" (the k largest of that sign), "larger" (per layer the
    side with the larger mean magnitude over its k). ask.mean: one value per layer instead of the
    values (RedSync's sign_mean; needs a sign). ask.first: the first histogram, from
    ``compensate`` with the same sign. ask.value_dtype: the values as they travel
    (float32/float16/bfloat16). ask.update: subtract from x what receivers will decode (the
    values as sent, or the mean), in the same pass (error feedback); ask.velocity: also zero it
    at the positions (DGC's masking).
    """
    R, active = sides(ask.sign)
    index_dtype = ask.index_dtype or torch.int32
    _check("x", x, seg.n)
    _check("velocity", ask.velocity, seg.n)
    if ask.mean and ask.sign is None:
        raise ValueError("select: mean=True (sign_mean) needs sign='pos', 'neg' or 'larger'")
    if index_dtype not in (torch.int32, torch.int64) or ask.value_dtype not in _GRAD_DTYPES:
        raise ValueError(f"select: index_dtype={index_dtype} must be int32/int64 and value_dtype="
                         f"{ask.value_dtype} one of {_GRAD_DTYPES}")
    if ask.velocity is not None and not ask.update:
        raise ValueError("select: velocity masking comes with update=True")
    hist = ask.first
    if torch.is_tensor(hist) and (tuple(hist.shape) != (len(seg) * R, BINS[0]) or hist.dtype != torch.int32):
        raise ValueError(f"first: need the ({len(seg) * R}, {BINS[0]}) int32 histogram that compensate() "
                         f"returns for sign={ask.sign!r}, got {tuple(hist.shape)} {hist.dtype}")
    impl = kernels(contract.backend, x)
    # ask.state: a dict the caller keeps, where a backend that takes hints keeps each layer's last
    # k-th key to start the next step's search from (the result does not depend on it)
    hints = {"hints": ask.state} if isinstance(ask.state, dict) and getattr(impl, "takes_hints", False) else {}
    pos, vals, means, bad, kth, side = impl.select(seg, x, R, active, k_rows(seg, x.device, ask.sign), hist,
                                                   index_dtype, ask.value_dtype, ask.mean, ask.update, ask.velocity,
                                                   **hints)
    return Selection(pos, seg.ks, values=None if ask.mean else vals, means=means if ask.mean else None,
                     nonfinite=bad, kth=kth, side=None if ask.sign is None else side)


def decode_add(seg: Segments, out: torch.Tensor, positions: torch.Tensor,
               values: torch.Tensor | None = None, *, means: torch.Tensor | None = None,
               alpha: float = 1.0, zero: torch.Tensor | None = None, backend: str = "auto") -> None:
    """out[offsets[i] + p] += alpha * v for every message, in rank order (deterministic).

    positions: (N, K) or (K,) layer-local (int32/int64), each layer's ascending, as ``select``
    returns them; values: the same shape, any float dtype (the wire's), or ``means``: (N, L)
    or (L,), one value per layer. ``zero``: a float32 buffer set to 0 at every decoded position
    (DGC's momentum masking of the velocity)."""
    _check("out", out, seg.n)
    _check("zero", zero, seg.n)
    if seg.k_total == 0:
        return
    pos = positions.reshape(-1, seg.k_total)
    if positions.dim() not in (1, 2) or positions.shape[-1] != seg.k_total \
            or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions: need (N, {seg.k_total}) or ({seg.k_total},) int32/int64, "
                         f"got {tuple(positions.shape)} {positions.dtype}")
    if (values is None) == (means is None):
        raise ValueError("decode_add: pass exactly one of values (per position) and means (per layer)")
    if values is not None and values.reshape(-1).numel() != pos.numel():
        raise ValueError(f"values: need the shape of positions {tuple(positions.shape)}, got {tuple(values.shape)}")
    if means is not None and means.reshape(-1).numel() != pos.shape[0] * len(seg):
        raise ValueError(f"means: need ({pos.shape[0]}, {len(seg)}), one per rank and layer, got {tuple(means.shape)}")
    vals = None if values is None else values.reshape(pos.shape).contiguous()
    mns = None if means is None else means.reshape(pos.shape[0], len(seg)).float().contiguous()
    _step(kernels(backend, out), "decode_add")(seg, out, pos.contiguous(), vals, mns, float(alpha), zero)
