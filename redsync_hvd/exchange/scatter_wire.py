"""The bytes one rank sends one owner in a sparse reduce-scatter (``reduce_scatter.py``): step 2's
alltoall chunk and, where positions or values are coded, step 5's kept piece.

    [counts (L,) int32 | with golomb: nbytes (L,) int32 |
     with int8: scales (L,) fp32, with sign-mean: means (L,) fp32 | positions | values], padded to 8

The fixed-size fields come first, so every view stays aligned whatever the codes' lengths.
Positions are each layer's own (not the bucket's): int32 each, or per layer the Golomb-Rice code of
their sorted places in the owner's region (``core/golomb.py``; ``Regions.local``: an owner's share
of k/N entries among n/N places keeps the layer's density, so a code stays as short whatever N),
the codes padded together to 4 bytes. A code's Rice parameter is not sent: the receiver derives
it from the count and the region's size, as the sender chose it (``core/golomb.py:choose_b``).
Values are one per position in the wire's dtype: fp32, fp16, or int8 codes, worth code * the layer's scale
(``compressors/codec.py``, whose rounding a sender's residual has already kept). Sign-mean sends no
values: every position of a layer is worth its mean.

Coded, a pair costs about 1 + log2(1/d) + 1 bits of position and 1 byte of value at density d,
against 4 + 2 bytes raw with fp16: at d = 0.01 about 2.1 bytes for 6.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compressors.codec import MessageCodec
from ..core.golomb import choose_b, decode_positions, encode_positions
from ..core.wire import to_wire

_ALIGN = 8
_INT8 = MessageCodec("int8")


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, as a flat uint8 view."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def padding(nbytes: int, align: int = _ALIGN) -> int:
    return -nbytes % align


@dataclass(frozen=True)
class ChunkFormat:
    """One chunk's layout for a bucket of ``numels`` layers; see the module docstring."""
    numels: tuple
    value_dtype: torch.dtype = torch.float32   # float32, float16 or int8 (codes with a scale per layer)
    golomb: bool = False
    sign_mean: bool = False

    @property
    def scaled(self) -> bool:
        return self.value_dtype == torch.int8

    def quantize(self, values: list) -> tuple:
        """Per layer fp32 values -> (what travels, one per position; scales (L,) fp32 or None;
        their fp32 worth, whose difference from ``values`` the sender keeps)."""
        if self.scaled:
            coded = [_INT8.to_wire(v) for v in values]
            worth = [c.float() * s for c, s in coded]
            return torch.cat([c for c, _ in coded]), torch.cat([s for _, s in coded]), torch.cat(worth)
        wire = to_wire(torch.cat(values), self.value_dtype)
        return wire, None, wire.float()

    def pack(self, counts: list, positions: torch.Tensor, values: torch.Tensor | None,
             per_layer: torch.Tensor | None, ranges: list | None = None) -> torch.Tensor:
        """counts: entries per layer; positions: each layer's own, layer after layer (with golomb
        sorted within a layer, each below its layer's ``ranges``: the layer's size by default);
        values: the wire's, in the same order (None with sign-mean); per_layer: (L,) fp32 scales
        (int8) or means (sign-mean), else None."""
        parts = [raw_bytes(torch.tensor(counts, dtype=torch.int32, device=positions.device))]
        if self.golomb:
            codes = [encode_positions(p.cpu(), n)[0] for n, p in zip(ranges or self.numels, positions.split(counts))]
            sizes = [c.numel() for c in codes]
            parts += [raw_bytes(torch.tensor(sizes, dtype=torch.int32, device=positions.device))]
        if per_layer is not None:
            parts.append(raw_bytes(per_layer.float()))
        if self.golomb:
            body = torch.cat(codes).to(positions.device) if codes else positions.new_zeros(0, dtype=torch.uint8)
            parts += [body, body.new_zeros(padding(body.numel(), 4))]
        else:
            parts.append(raw_bytes(positions.to(torch.int32)))
        if values is not None:
            parts.append(raw_bytes(values))
        nbytes = sum(p.numel() for p in parts)
        return torch.cat(parts + [parts[0].new_zeros(padding(nbytes))])

    def unpack(self, chunk: torch.Tensor, ranges: list | None = None) -> tuple:
        """(layer of every entry int64, its own position int64, its fp32 value) from one chunk;
        ``ranges``: as :meth:`pack` was given them."""
        L, at = len(self.numels), 4 * len(self.numels)
        counts = chunk[:at].view(torch.int32).tolist()
        n = sum(counts)
        if self.golomb:
            sizes = chunk[at:at + 4 * L].view(torch.int32).tolist()
            bs = [choose_b(c, places) for c, places in zip(counts, ranges or self.numels)]
            at += 4 * L
        per_layer = None
        if self.scaled or self.sign_mean:
            per_layer = chunk[at:at + 4 * L].view(torch.float32)
            at += 4 * L
        if self.golomb:
            pos, start = [], at
            for c, b, s in zip(counts, bs, sizes):
                pos.append(decode_positions(chunk[start:start + s].cpu(), c, b).to(chunk.device))
                start += s
            positions = torch.cat(pos) if pos else chunk.new_zeros(0, dtype=torch.int64)
            at = start + padding(start - at, 4)
        else:
            positions = chunk[at:at + 4 * n].view(torch.int32).to(torch.int64)
            at += 4 * n
        lid = torch.repeat_interleave(torch.arange(L, device=chunk.device), torch.tensor(counts, device=chunk.device))
        if self.sign_mean:
            return lid, positions, per_layer[lid]
        size = torch.empty(0, dtype=self.value_dtype).element_size()
        values = chunk[at:at + size * n].view(self.value_dtype).float()
        return lid, positions, values * per_layer[lid] if self.scaled else values
