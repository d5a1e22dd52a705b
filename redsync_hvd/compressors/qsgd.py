"""QSGD: unbiased stochastic quantisation to s levels (Alistarh, Grubic, Li, Tomioka and Vojnovic,
"QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding", NeurIPS 2017).

The quantiser of section 3.1, for v in R^d and s levels:

    Q_s(v_i) = ||v||_2 * sign(v_i) * xi_i(v, s)
    l        = the integer in [0, s) with |v_i| / ||v||_2 in [l / s, (l + 1) / s]
    xi_i     = (l + 1) / s   with probability  p_i = s * |v_i| / ||v||_2 - l
               l / s         otherwise

so E[xi_i] = |v_i| / ||v||_2 and E[Q_s(v)] = v (unbiased), with
E||Q_s(v) - v||^2 <= min(d / s^2, sqrt(d) / s) * ||v||^2 (Lemma 3.1). The paper quantises
buckets of d consecutive elements, one norm each (d = 512 in its experiments), and sends
norm, signs and levels, Elias-coded; here each level and its sign is one fixed-width code.

Per layer:

  1. ``compress``: cut x into buckets of ``bucket_size`` (the last one zero-padded); per bucket
     the norm; a = s * |v_i| / norm; level = floor(a + u_i) with u_i ~ U[0, 1) from a
     generator seeded by (seed, rank, step, layer): it is l + 1 with probability a - l
     exactly; code = sign(v_i) * level + s in [0, 2s], packed ``bits`` per element. The
     message (fp32 norms, uint8 codes) travels by allgather: codes of different workers
     have different norms and cannot be summed as codes.
  2. ``decompress_add``: out += alpha * norm / s * (code - s).
  3. with ``residual`` the exchange keeps v - Q_s(v) (the paper has no error feedback).

s = 2**(bits - 1) - 1: bits=2 is ternary (s = 1), bits=4 gives s = 7, bits=8 gives s = 127.
"""
from __future__ import annotations

import torch

from ..config.baselines import QSGDConfig
from ..core import bitpack
from ..core.wire import wide_norm
from .base import Compressor, Layer, Message, Wire


def levels(bits: int) -> int:
    """s, the number of positive levels a code of ``bits`` bits holds next to its sign."""
    return 2 ** (bits - 1) - 1


def rounding_seed(seed: int, rank: int, step: int, index: int) -> int:
    """The rounding generator's seed: distinct per worker (independent noise averages out),
    step and layer; a function of them alone, so a resumed run draws the same noise."""
    for part in (rank, step, index):
        seed = (seed * 1_000_003 + part) % (2 ** 61 - 1)
    return seed


def _buckets(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """x as (buckets, bucket_size), the last bucket zero-padded."""
    pad = (-x.numel()) % bucket_size
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(-1, bucket_size)


def quantize(x: torch.Tensor, s: int, bucket_size: int, generator: torch.Generator) -> tuple:
    """Step 1 for a flat fp32 x: (norm per bucket, signed levels in [-s, s] per element)."""
    v = _buckets(x, bucket_size)
    norms = wide_norm(v, dim=1)   # finite for finite v: fp32's sum of squares overflows past 1.8e19
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))   # an all-zero bucket stays zero
    a = v.abs().mul_(s / safe.unsqueeze(1))
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=a.dtype)
    level = a.add_(u).floor_().clamp_(max=s)   # l + 1 with probability a - l
    signed = level.mul_(torch.sign(v)).reshape(-1)[:x.numel()]
    return norms, signed


def dequantize(norms: torch.Tensor, signed: torch.Tensor, s: int, bucket_size: int) -> torch.Tensor:
    """Step 2: norm / s * signed level, flat, as many elements as ``signed``."""
    scale = (norms.to(torch.float32) / s).repeat_interleave(bucket_size)[:signed.numel()]
    return signed.to(torch.float32) * scale


class QSGDCompressor(Compressor):
    collective = "allgather"

    def __init__(self, config=None, comm=None):
        super().__init__(config if config is not None else QSGDConfig())
        self.comm = comm     # set by the exchange; only its rank is used, to seed the rounding
        self.s = levels(self.config.bits)

    def wire(self, layer: Layer) -> Wire:
        buckets = -(-layer.numel // self.config.bucket_size)
        return Wire((torch.float32, torch.uint8), ("scalars", "values"),
                    (buckets, -(-layer.numel * self.config.bits // 8)))

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        rank = self.comm.rank if self.comm is not None else 0
        seed = rounding_seed(self.config.seed, rank, step, layer.index)
        generator = torch.Generator(device=x.device).manual_seed(seed)
        norms, signed = quantize(x, self.s, self.config.bucket_size, generator)
        codes = bitpack.pack(signed.add_(self.s), self.config.bits)
        return Message([norms, codes], ("scalars", "values"))

    def decompress_add(self, out: torch.Tensor, tensors: list, layer: Layer, alpha: float = 1.0,
                       ctx=None) -> None:
        norms, codes = tensors
        signed = bitpack.unpack(codes.to(out.device), self.config.bits, layer.numel).to(torch.float32) - self.s
        out.add_(dequantize(norms.to(out.device), signed, self.s, self.config.bucket_size), alpha=alpha)
