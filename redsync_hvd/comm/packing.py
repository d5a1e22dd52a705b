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
    """Write ``header`` (int32 counts, unpadded) and then ``tensors``, laid out as :func:`pack`'s
    payload (each padded to 8 bytes; the padding is the row's zeros), into the zeroed uint8
    ``row``, with one copy call: no payload is built first and copied again. Each tensor lands in a
    slice of the row viewed as its dtype (one view per dtype, not two ops per tensor)."""
    views = _typed(row, [torch.int32] + [t.dtype for t in tensors])
    dst = [_slot(views, 0, len(header), torch.int32)]
    src, at = [torch.tensor(header, dtype=torch.int32, device=row.device)], 4 * len(header)
    for t in tensors:
        n, size = t.numel(), t.element_size()
        if n:
            slot = _slot(views, at, n, t.dtype)
            flat = t.reshape(-1) if t.dim() != 1 else t
            dst.append(slot if slot is not None else row[at:at + n * size])
            src.append(flat if slot is not None else flat.contiguous().view(torch.uint8))
        at += _padded(n * size)
    torch._foreach_copy_(dst, src)


def unpack_rows(rows: torch.Tensor, at: int, counts: list, dtypes: list) -> list[list]:
    """Every rank's tensors, cut from its row of ``rows`` (uint8 [size, bytes], each rank's
    :func:`pack_row` from byte ``at``) by that rank's ``counts``: views of the rows as each dtype,
    copied out first only where an offset does not suit a dtype's alignment."""
    width = rows.shape[1]
    flat = rows.reshape(-1)
    views = _typed(flat, dtypes)
    out = []
    for r, rank_counts in enumerate(counts):
        nbytes = payload_bytes(rank_counts, dtypes)
        if at + nbytes > width:
            raise RuntimeError(f"rank {r}'s message sizes {rank_counts} describe {nbytes} bytes but its row holds "
                               f"{width - at}: ranks disagree on the bucket layout (different models or configs?)")
        offset, tensors = r * width + at, []
        for n, dtype in zip(rank_counts, dtypes):
            piece = _slot(views, offset, n, dtype)
            tensors.append(piece if piece is not None else flat[offset:offset + n * dtype.itemsize].clone().view(dtype))
            offset += _padded(n * dtype.itemsize)
        out.append(tensors)
    return out


def _typed(flat: torch.Tensor, dtypes: list) -> dict:
    """{dtype: the uint8 buffer ``flat`` viewed as it}, for the dtypes whose size its offset and
    length allow."""
    return {d: flat.view(d) for d in set(dtypes)
            if flat.numel() % d.itemsize == 0 and flat.storage_offset() % d.itemsize == 0}


def _slot(views: dict, at: int, n: int, dtype: torch.dtype):
    """n elements of ``dtype`` from byte ``at`` of a :func:`_typed` buffer, or None where ``at``
    does not suit the dtype (or its view could not be made)."""
    view, size = views.get(dtype), dtype.itemsize
    if view is None or at % size:
        return None
    return view[at // size:at // size + n]


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
