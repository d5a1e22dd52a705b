"""Compressors C(.) for decentralized training: what one worker sends its neighbours.

Every quantiser has the same small interface, on flat fp32 tensors:

- ``encode(x, generator) -> list[Tensor]``: the wire tensors (what travels).
  Randomness comes only from ``generator`` (a ``torch.Generator``), so a run is
  reproducible from its seed.
- ``decode(wire, numel) -> Tensor``: fp32 tensor of ``numel`` elements. Decoding
  is a pure function of the wire tensors (plain element-wise float ops), so the
  sender and every receiver get bit-identical results; DCD/ECD rely on this.
- ``wire_bytes(wire) -> int``: bytes of the wire tensors (exchange headers excluded).
- ``n_wire``: how many tensors ``encode`` returns (fixed per quantiser).

Stochastic rounding: a value u between grid points k and k+1 becomes k+1 with
probability u - k, else k, so E[decode(encode(x))] = x for values inside the
grid, with per-element variance (u-k)(k+1-u) * spacing^2 <= spacing^2 / 4.
"""
from __future__ import annotations

import math

import torch

from ..core.select import Contract, select, single

TOPK = Contract("exact", finite=False)   # torch.topk's ranking: the gossip checks nothing here

BITS = (8, 4, 2)


def _check_bits(bits: int) -> int:
    if int(bits) not in BITS:
        raise ValueError(f"bits={bits!r} is not supported; choose one of {list(BITS)} "
                         "(codes are packed 1, 2 or 4 per byte)")
    return int(bits)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2**bits -> uint8 bytes, 8 // bits codes per byte (little end first)."""
    per = 8 // bits
    if per == 1:
        return codes
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    codes = codes.view(-1, per)
    out = codes[:, 0].clone()
    for i in range(1, per):
        out |= codes[:, i] << (bits * i)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 bytes -> ``numel`` uint8 codes."""
    per = 8 // bits
    if per == 1:
        return packed[:numel]
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=1).reshape(-1)[:numel]


def _stochastic_round(u: torch.Tensor, generator) -> torch.Tensor:
    low = torch.floor(u)
    return low + (torch.rand(u.shape, generator=generator, device=u.device, dtype=u.dtype) < (u - low)).to(u.dtype)


class Quantizer:
    """Base class; see the module docstring for the contract."""
    n_wire = 1
    unbiased = True

    def encode(self, x: torch.Tensor, generator=None) -> list:
        raise NotImplementedError

    def decode(self, wire: list, numel: int) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def wire_bytes(wire: list) -> int:
        return sum(t.numel() * t.element_size() for t in wire)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


class IdentityQuantizer(Quantizer):
    """No compression: the fp32 tensor itself (4 bytes per element). Used by plain D-PSGD."""

    def encode(self, x, generator=None):
        return [x.detach().to(torch.float32).reshape(-1).clone()]

    def decode(self, wire, numel):
        return wire[0]


class MinMaxQuantizer(Quantizer):
    """Per-tensor min/max grid with 2**bits levels: spacing = (max - min) / (2**bits - 1).

    The error is *relative*: spacing shrinks with the tensor's range, so it suits
    DCD-PSGD, whose message (a model difference) shrinks as training converges.
    Wire: packed uint8 codes (1, 2 or 4 per byte for 8, 4, 2 bits) and one fp32
    tensor ``[min, spacing]``. Unbiased everywhere (the grid covers [min, max]).
    A constant tensor has spacing 0 and decodes exactly.
    """
    n_wire = 2

    def __init__(self, bits: int = 8):
        self.bits = _check_bits(bits)
        self.levels = (1 << self.bits) - 1

    def encode(self, x, generator=None):
        x = x.detach().to(torch.float32).reshape(-1)
        if x.numel() == 0:
            return [torch.zeros(0, dtype=torch.uint8), torch.zeros(2)]
        lo, hi = x.min(), x.max()
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            raise FloatingPointError("MinMaxQuantizer.encode: non-finite values in the tensor")
        scale = (hi - lo) / self.levels
        if scale <= 0:
            codes = torch.zeros(x.numel(), dtype=torch.uint8, device=x.device)
        else:
            u = ((x - lo) / scale).clamp_(0, self.levels)
            codes = _stochastic_round(u, generator).clamp_(0, self.levels).to(torch.uint8)
        return [pack_codes(codes, self.bits), torch.stack([lo, scale]).to(torch.float32)]

    def decode(self, wire, numel):
        packed, scalars = wire
        codes = unpack_codes(packed, self.bits, numel).to(torch.float32)
        return codes.mul_(scalars[1]).add_(scalars[0])

    def spacing(self, x: torch.Tensor) -> float:
        """Grid spacing encode would use for ``x`` (variance bound: spacing**2 / 4)."""
        return float((x.max() - x.min()) / self.levels) if x.numel() else 0.0


class FixedGridQuantizer(Quantizer):
    """Grid of fixed spacing ``step`` centred at 0: points k*step for k in [-K, K],
    K = 2**(bits-1) - 1 (8 bits: +-127 steps, 4 bits: +-7, 2 bits: +-1; 2K+1 codes).

    The error is *absolute* (variance <= step**2 / 4 whatever the value), the kind
    ECD-PSGD tolerates. Unbiased only inside the clipping range [-K*step, K*step];
    values outside are clipped to the end point (biased). ``clipped`` counts the
    elements clipped so far (check it: ECD's extrapolated message grows like t/2
    times the model change). Wire: packed uint8 codes only; ``step`` is configuration.
    """
    n_wire = 1

    def __init__(self, bits: int = 8, step: float = 0.01):
        self.bits = _check_bits(bits)
        if not (step > 0 and math.isfinite(step)):
            raise ValueError(f"step={step!r} must be a positive finite grid spacing")
        self.step = float(step)
        self.k = (1 << (self.bits - 1)) - 1
        self.clipped = 0

    @property
    def limit(self) -> float:
        """Largest magnitude represented without clipping."""
        return self.k * self.step

    def encode(self, x, generator=None):
        x = x.detach().to(torch.float32).reshape(-1)
        u = x / self.step
        over = (u.abs() > self.k)
        if bool(over.any()):
            self.clipped += int(over.sum())
        u = u.clamp(-self.k, self.k)
        codes = (_stochastic_round(u, generator).clamp_(-self.k, self.k) + self.k).to(torch.uint8)
        return [pack_codes(codes, self.bits)]

    def decode(self, wire, numel):
        codes = unpack_codes(wire[0], self.bits, numel).to(torch.float32)
        return codes.sub_(self.k).mul_(self.step)


class TopKSparsifier(Quantizer):
    """Sends k = ceil(density * n) (int32 index, fp32 value) pairs; the rest decodes as 0.

    - ``unbiased=True`` (default): k positions drawn uniformly without replacement
      (random-k) from the generator, values scaled by n/k, so E[decode] = x
      (variance x**2 * (n/k - 1) per element: large at low density).
    - ``unbiased=False``: plain top-k by magnitude, unscaled. Deterministic and
      BIASED (small entries are never sent); the convergence results for DCD/ECD
      assume an unbiased C, so use it only as a comparison.
    """
    n_wire = 2

    def __init__(self, density: float = 0.1, unbiased: bool = True):
        if not (0.0 < float(density) <= 1.0):
            raise ValueError(f"density={density!r} is outside (0, 1]: the fraction of elements sent")
        self.density = float(density)
        self.unbiased = bool(unbiased)

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.density * numel))) if numel else 0

    def encode(self, x, generator=None):
        x = x.detach().to(torch.float32).reshape(-1)
        n, k = x.numel(), self.k(x.numel())
        if self.unbiased:
            idx = torch.randperm(n, generator=generator, device=x.device)[:k]
            idx = torch.sort(idx).values
            values = x[idx] * (n / k) if k else x[idx]
        else:
            idx = torch.sort(select(single(n, k), x, TOPK).positions).values
            values = x[idx].clone()
        return [idx.to(torch.int32), values]

    def decode(self, wire, numel):
        idx, values = wire
        out = torch.zeros(numel, dtype=torch.float32, device=values.device)
        out[idx.long()] = values
        return out


def build_quantizer(name: str = "minmax", bits: int = 8, step: float = 0.01, density: float = 0.1,
                    unbiased: bool = True) -> Quantizer:
    """``name``: none | minmax | grid | topk (the ``quantizer`` knob of the config)."""
    if name in ("none", "identity", None):
        return IdentityQuantizer()
    if name == "minmax":
        return MinMaxQuantizer(bits)
    if name == "grid":
        return FixedGridQuantizer(bits, step)
    if name == "topk":
        return TopKSparsifier(density, unbiased)
    raise ValueError(f"quantizer={name!r} is unknown; choose one of ['none', 'minmax', 'grid', 'topk']")
