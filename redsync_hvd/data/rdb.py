"""R's lazy-load databases: the ``data/Rdata.rdx`` + ``data/Rdata.rdb`` of an installed R package.

An R package's data sets are stored as one database: the ``.rdx`` is one serialized R list
(gzip-compressed, as ``saveRDS`` writes it) ``list(variables = list(<name> = c(offset, length),
...), references = list(), compressed = TRUE)``; the ``.rdb`` holds, at each ``offset``, an
entry of ``length`` bytes: the uncompressed size (4 bytes, big-endian), for ``compressed`` 2 or
3 one byte naming the codec (``Z`` zlib, ``2`` bzip2, ``X`` xz, ``0`` none), then the compressed
serialization of that one object (R's ``src/main/serialize.c``, ``R_decompress1..3``). The
serialized objects are parsed by PyPI's ``rdata`` (Alvarez-Rodriguez et al.), which reads R's
serialization format but not the database around it.
"""
from __future__ import annotations

import bz2
import lzma
import os
import struct
import zlib
from typing import Iterable, Optional

RDX, RDB = "Rdata.rdx", "Rdata.rdb"
_CODECS = {b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": bytes}


def _parse(raw: bytes):
    import rdata  # here, not at the top: it imports pandas and xarray, which only austen needs
    return rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))


def index(folder: str) -> dict:
    """{object name: (offset, length)} and the ``compressed`` code of the database in ``folder``."""
    with open(os.path.join(folder, RDX), "rb") as f:
        rdx = _parse(f.read())
    variables = {str(k): (int(v[0]), int(v[1])) for k, v in rdx["variables"].items()}
    compressed = int(rdx["compressed"][0]) if "compressed" in rdx else 1
    return {"variables": variables, "compressed": compressed}


def _unpack(entry: bytes, compressed: int, where: str) -> bytes:
    (size,) = struct.unpack(">I", entry[:4])
    if compressed == 1:
        body = zlib.decompress(entry[4:])
    elif compressed in (2, 3) and entry[4:5] in _CODECS:
        body = _CODECS[entry[4:5]](entry[5:])
    else:
        raise ValueError(f"{where}: unknown compression (compressed={compressed}, codec byte {entry[4:5]!r})")
    if len(body) != size:
        raise ValueError(f"{where}: entry says {size} bytes but holds {len(body)}; the database is damaged")
    return body


def read_lazyload(folder: str, names: Optional[Iterable[str]] = None) -> dict:
    """{name: Python value} of the objects ``names`` (default: all) of the database in ``folder``;
    a character vector comes back as a list of str (R's NA as None)."""
    idx = index(folder)
    wanted = list(idx["variables"]) if names is None else list(names)
    missing = [n for n in wanted if n not in idx["variables"]]
    if missing:
        raise ValueError(f"{os.path.join(folder, RDX)} holds no object {missing}; it holds {sorted(idx['variables'])}")
    out = {}
    with open(os.path.join(folder, RDB), "rb") as f:
        for name in wanted:
            offset, length = idx["variables"][name]
            f.seek(offset)
            body = _unpack(f.read(length), idx["compressed"], f"{os.path.join(folder, RDB)} ({name})")
            value = _parse(body)
            out[name] = value.tolist() if hasattr(value, "tolist") else value
    return out
