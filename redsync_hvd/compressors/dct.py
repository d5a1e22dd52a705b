"""The largest DCT coefficients of each block, with error feedback: DeMo's transmission (Peng,
Quesnelle and Kingma, "DeMo: Decoupled Momentum Optimization", 2024).

Top-k in the coordinates moves k weights a step: at density d a weight waits about 1/d steps,
and on a run of a few thousand steps that delay is a large share of the run. DeMo sends the
largest coefficients of a blockwise discrete cosine transform instead. One coefficient is a
cosine over its whole block, so every weight of a block moves every step, by the block's
smoothest and strongest components; what was not sent stays in the residual, as in top-k.

Per layer, with x = g + r (or the worker's own Adam step + r: the memory decides, as for top-k):

    1. blocks   x as a matrix (dim 0 by the rest; a vector is one row), padded with zeros to
                whole blocks of b_r x b_c, b = min(chunk, the side);
    2. encode   C = D_r X D_c^T per block, D the orthonormal DCT-II matrix;
    3. select   the k_b = max(1, round(density * b_r * b_c)) largest |C| of every block;
                send (int16 position in the block, value in fp16 or fp32) by allgather;
    4. decode   X' = D_r^T C' D_c of what was sent, cropped to the layer; the residual keeps
                x - X' (``decompress_add`` with alpha = -1), so it holds exactly what the
                receivers did not get.

The transform is orthonormal: a block's energy is the sum of its squared coefficients, so the
k_b largest keep the most of it that k_b numbers can. What it costs: 2 (b_r + b_c) multiply-adds
per element to encode, as many per message decoded (N + 1 a step): on a CPU this is the step's
largest cost for chunk 64; a GPU does it as batched matrix products.

By default only what travels changes: the memory (plain residual, DGC's velocity, or the worker's
own Adam step) and the wrapped optimizer keep their roles. DeMo's other two parts are keys, for
error feedback in update units (torch Adam and AdamW): ``decay``, a residual whose unsent part
fades, and ``sign_step``, every weight moved by lr times the sign of the decoded average
(memory/adam.py, torch/update_units.py).
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from ..config.compression import AllgatherConfig, PolicyConfig
from ..core.segments import Segments
from ..core.select import Contract, select
from .base import Compressor, Layer, Message, Wire

# the k largest |coefficient| of every block, torch.topk's ranking (the exchange checks finiteness)
EXACT = Contract("exact", finite=False)

VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


class DCTConfig(AllgatherConfig):
    """The k largest DCT coefficients of every block of a compressed layer, by allgather."""
    frameworks: ClassVar[tuple] = ("torch",)
    engines: ClassVar[tuple] = ("horovod", "ddp")
    sharded_limits: ClassVar[str] = "sends coefficients of blocks that span FSDP's shards"
    density: float = Field(0.001, description="fraction of each block's DCT coefficients sent per step, in (0, 1]; "
                                              "at least one per block")
    chunk: int = Field(64, ge=2, le=128, description="block side: a block is min(chunk, rows) x min(chunk, cols) "
                                                     "of the layer as a matrix. Larger blocks spread a coefficient "
                                                     "over more weights and cost 2*chunk multiply-adds per element "
                                                     "per transform")
    values: Literal["fp32", "fp16"] = Field(
        "fp16", description="how coefficients travel: fp16 (2 bytes, with the int16 position 4 bytes a "
                            "coefficient) | fp32 (6 bytes a coefficient)")
    decay: float = Field(
        1.0, gt=0, le=1, description="DeMo's decaying momentum: each worker's residual is multiplied by decay before "
                                     "its own Adam step joins it, so what waited longer than about 1/(1-decay) steps "
                                     "fades instead of arriving late (DeMo: 0.999). 1: error feedback keeps it whole. "
                                     "Needs error feedback in update units (torch Adam or AdamW)")
    sign_step: bool = Field(
        False, description="DeMo's step: every weight of a compressed layer moves by lr * the sign of the decoded "
                           "average (plus AdamW's decoupled decay), so a block moves at Adam's pace however few "
                           "coefficients were sent; false: by lr * the average. Needs update units, as decay")
    policy: PolicyConfig = Field(default_factory=lambda: PolicyConfig(min_compress_numel=4096),
                                 description="which layers compress (min_compress_numel 4096 unless given)")

    @model_validator(mode="after")
    def _dense_decode(self):
        if self.sparse_update is True or self.aggregation != "allgather":
            raise ValueError("method: dct decodes every message into a whole layer: it travels by allgather and "
                             "is applied by the optimizer; remove sparse_update and aggregation")
        if self.dgc.momentum_correction and self.dgc.momentum_masking:
            raise ValueError("dgc.momentum_masking zeroes the velocity at the positions sent, but method: dct sends "
                             "DCT coefficients, not positions: set dgc.momentum_masking: false")
        return self

    @model_validator(mode="after")
    def _demo_needs_update_units(self):
        if (self.decay != 1.0 or self.sign_step) and not self.in_update_units:
            raise ValueError("decay and sign_step act on each worker's own Adam steps: set feedback_units: auto "
                             "or update (and residual: true), or remove decay and sign_step")
        return self

    @property
    def may_update_in_step(self) -> bool:
        return False

    @property
    def residual_decay(self) -> float:
        return self.decay

    @property
    def steps_by_sign(self) -> bool:
        return self.sign_step


@lru_cache(maxsize=32)
def _dct_matrix(n: int, device: str) -> torch.Tensor:
    """The orthonormal DCT-II matrix, D[k, i] = s_k cos(pi (2i + 1) k / 2n), D D^T = I."""
    i = torch.arange(n, dtype=torch.float64)
    d = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(torch.float32).to(device)


@lru_cache(maxsize=256)
def _layout(count: int, size: int, k: int) -> Segments:
    """k of every one of ``count`` blocks of ``size`` coefficients, made once per layer shape and k."""
    return Segments([size] * count, [k] * count)


class Blocks:
    """A layer's block grid: rows x cols as a matrix, blocks of br x bc, gr x gc of them."""

    def __init__(self, layer: Layer, chunk: int, density: float):
        shape = layer.shape if len(layer.shape) >= 2 else (1, layer.numel)
        self.rows, self.cols = shape[0], layer.numel // max(shape[0], 1)
        self.br, self.bc = min(chunk, self.rows), min(chunk, self.cols)
        self.gr, self.gc = -(-self.rows // self.br), -(-self.cols // self.bc)
        self.count, self.size = self.gr * self.gc, self.br * self.bc
        self.k = min(self.size, max(1, round(density * self.size)))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(count, size) coefficients of flat x."""
        m = torch.zeros(self.gr * self.br, self.gc * self.bc, dtype=torch.float32, device=x.device)
        m[:self.rows, :self.cols] = x.reshape(self.rows, self.cols)
        b = m.reshape(self.gr, self.br, self.gc, self.bc).transpose(1, 2)
        dr, dc = _dct_matrix(self.br, str(x.device)), _dct_matrix(self.bc, str(x.device))
        return (dr @ b @ dc.T).reshape(self.count, self.size)

    def decode(self, coef: torch.Tensor) -> torch.Tensor:
        """Flat layer of (count, size) coefficients, cropped to the layer."""
        dr, dc = _dct_matrix(self.br, str(coef.device)), _dct_matrix(self.bc, str(coef.device))
        b = dr.T @ coef.reshape(self.gr, self.gc, self.br, self.bc) @ dc
        m = b.transpose(1, 2).reshape(self.gr * self.br, self.gc * self.bc)
        return m[:self.rows, :self.cols].reshape(-1)


class DCTCompressor(Compressor):
    collective = "allgather"

    def _blocks(self, layer: Layer) -> Blocks:
        return Blocks(layer, self.config.chunk, layer.density)

    def wire(self, layer: Layer) -> Wire:
        blocks = self._blocks(layer)
        n = blocks.count * blocks.k
        return Wire((torch.int16, VALUE_DTYPES[self.config.values]), ("indices", "values"), (n, n), fixed=True)

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        blocks = self._blocks(layer)
        coef = blocks.encode(x)
        layout = _layout(blocks.count, blocks.size, blocks.k)
        pos = select(layout, coef.reshape(-1), EXACT).positions.reshape(blocks.count, blocks.k)
        values = coef.gather(1, pos).to(VALUE_DTYPES[self.config.values])
        return Message([pos.to(torch.int16).reshape(-1), values.reshape(-1)], ("indices", "values"),
                       selected=pos.numel(), k=pos.numel())

    def decompress_add(self, out: torch.Tensor, tensors: list, layer: Layer, alpha: float = 1.0,
                       ctx=None) -> None:
        blocks = self._blocks(layer)
        pos, values = (t.to(out.device) for t in tensors)
        coef = torch.zeros(blocks.count, blocks.size, dtype=torch.float32, device=out.device)
        coef.scatter_(1, pos.to(torch.int64).reshape(blocks.count, blocks.k),
                      values.to(torch.float32).reshape(blocks.count, blocks.k))
        out.add_(blocks.decode(coef), alpha=alpha)
