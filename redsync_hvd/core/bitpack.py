"""Small unsigned codes packed into bytes: 1-bit signs (EF-signSGD), 2/4/8-bit levels (QSGD).

Element ``i`` of a group of ``8 // bits`` elements sits at bit offset ``bits * i`` of its
byte (little-endian within the byte), so unpacking is one shift and one mask per offset.
The last byte is padded with zeros; the caller keeps the element count.
"""
from __future__ import annotations

import torch

_WIDTHS = (1, 2, 4, 8)


def _check(bits: int) -> int:
    if bits not in _WIDTHS:
        raise ValueError(f"bits={bits!r}: codes must be 1, 2, 4 or 8 bits wide to pack whole into bytes")
    return 8 // bits


def packed_size(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take."""
    per = _check(bits)
    return (n + per - 1) // per


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat integer codes in [0, 2**bits) -> uint8 of ``packed_size(len, bits)`` bytes."""
    per = _check(bits)
    codes = codes.reshape(-1).to(torch.uint8)
    if per == 1:
        return codes.clone()
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    # the fields of one byte do not overlap, so their sum is their bitwise or
    return (codes.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 bytes -> the first ``n`` codes, as uint8."""
    per = _check(bits)
    if packed.numel() != packed_size(n, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold exactly {n} codes of {bits} bits "
                         f"({packed_size(n, bits)} bytes expected)")
    if per == 1:
        return packed.reshape(-1)[:n]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.reshape(-1, 1) >> shifts) & mask).reshape(-1)[:n]
