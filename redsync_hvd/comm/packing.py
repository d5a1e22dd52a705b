"""Fusing several layers' variable-size messages into one allgather.

A bucket's message on one rank is a header (element count of every wire tensor
of every layer, int32) plus one uint8 payload: the raw bytes of those tensors,
each padded to 8 bytes so it can be viewed back as its dtype without a copy.
Headers have a fixed size (the bucket's layers are the same on every rank), so
they are allgathered side by side with the payload and tell every receiver how
to cut the concatenated payloads, including ranks that sent zero elements.
Where every rank's row has one bounded size, header and payload share the row
(:func:`pack_row`, :func:`unpack_rows`).
"""
from __future__ import annotations

import torch

_ALIGN = 8


def _padded(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def pack(tensors: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """tensors -> (header int32 [len(tensors)], payload uint8)."""
    counts = torch.tensor([t.numel() for t in tensors], dtype=torch.int32)
    parts = []
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        pad = _padded(raw.numel()) - raw.numel()
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=raw.device))
    payload = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    return counts, payload


def unpack_gathered(headers: torch.Tensor, payload: torch.Tensor, dtypes: list, size: int) -> list[list]:
    """Cut the allgathered bytes back into per-rank lists of tensors.

    headers: int32 [size * len(dtypes)] as allgathered; payload: uint8 concatenation of
    every rank's payload; dtypes: the dtype of each wire tensor (same order on all ranks).
    """
    return _cut(payload, headers.view(size, len(dtypes)).tolist(), dtypes)


def unpack_fixed(payload: torch.Tensor, counts: list, dtypes: list, size: int) -> list[list]:
    """The same for messages whose element counts every rank knew before the step (no header
    was sent): every rank's payload has ``counts``. Reads nothing back from the device."""
    return _cut(payload, [list(counts)] * size, dtypes)


def payload_bytes(counts: list, dtypes: list) -> int:
    """The bytes of one rank's payload with these element counts (padding included)."""
    return sum(_padded(n * d.itemsize) for n, d in zip(counts, dtypes))


def pack_row(row: torch.Tensor, header: list, tensors: list) -> None:
    """Write ``header`` (int32 counts, unpadded) and then ``tensors``' bytes, laid out as
    :func:`pack`'s payload (each padded to 8 bytes; the padding is the row's zeros), into the
    zeroed uint8 ``row``, with one copy call: no payload is built first and copied again."""
    head = torch.tensor(header, dtype=torch.int32).view(torch.uint8)
    dst, src, at = [row[:head.numel()]], [head.to(row.device)], head.numel()
    for t in tensors:
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        if raw.numel():
            dst.append(row[at:at + raw.numel()])
            src.append(raw)
        at += _padded(raw.numel())
    torch._foreach_copy_(dst, src)


def unpack_rows(rows: torch.Tensor, at: int, counts: list, dtypes: list) -> list[list]:
    """Every rank's tensors, cut from its row of ``rows`` (uint8 [size, bytes], each rank's
    :func:`pack_row` from byte ``at``) by that rank's ``counts``: views, copied first only where
    the row's offset does not suit a dtype's alignment."""
    align = max((d.itemsize for d in dtypes), default=1)
    out = []
    for r, rank_counts in enumerate(counts):
        nbytes = payload_bytes(rank_counts, dtypes)
        if at + nbytes > rows.shape[1]:
            raise RuntimeError(f"rank {r}'s message sizes {rank_counts} describe {nbytes} bytes but its row holds "
                               f"{rows.shape[1] - at}: ranks disagree on the bucket layout (different models or "
                               "configs?)")
        payload = rows[r, at:at + nbytes]
        if payload.storage_offset() % align:
            payload = payload.clone()
        out.append(_cut(payload, [rank_counts], dtypes)[0])
    return out


def _cut(payload: torch.Tensor, counts: list, dtypes: list) -> list[list]:
    itemsizes = [d.itemsize for d in dtypes]
    expect = sum(_padded(n * sz) for rank_counts in counts for n, sz in zip(rank_counts, itemsizes))
    if expect != payload.numel():
        raise RuntimeError(f"allgather payload has {payload.numel()} bytes but the message sizes describe {expect}: "
                           "ranks disagree on the bucket layout (different models or configs?)")
    out, offset = [], 0
    for rank_counts in counts:
        tensors = []
        for n, dt, sz in zip(rank_counts, dtypes, itemsizes):
            nbytes = n * sz
            tensors.append(payload[offset:offset + nbytes].view(dt))
            offset += _padded(nbytes)
        out.append(tensors)
    return out
