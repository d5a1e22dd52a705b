"""Compressors by method name. Adding a method = a config class (config.py) and a line here."""
from __future__ import annotations

from typing import Any

from .base import Compressor, Layer, Message
from .config import CompressionConfig, method_names, parse_compression
from .dense import FP16Compressor, NoneCompressor
from .iwp import IWPCompressor
from .redsync import RedSyncCompressor
from .sbc import SBCCompressor
from .topk import RandomKCompressor, TopKCompressor

COMPRESSORS: dict[str, type] = {
    "none": NoneCompressor,
    "fp16": FP16Compressor,
    "topk": TopKCompressor,
    "randomk": RandomKCompressor,
    "redsync": RedSyncCompressor,
    "iwp": IWPCompressor,
    "sbc": SBCCompressor,
}


def build_compressor(compression: Any) -> tuple[Compressor, CompressionConfig]:
    """dict / config / Compressor object -> (compressor, config)."""
    if isinstance(compression, Compressor):
        cfg = compression.config if isinstance(compression.config, CompressionConfig) \
            else parse_compression({"method": "none"})
        return compression, cfg
    cfg = parse_compression(compression if compression is not None else {"method": "none"})
    if cfg.method not in COMPRESSORS:
        raise ValueError(f"compression.method={cfg.method!r} has a config but no compressor; "
                         f"available: {sorted(COMPRESSORS)}")
    return COMPRESSORS[cfg.method](cfg), cfg


__all__ = ["Compressor", "Layer", "Message", "CompressionConfig", "COMPRESSORS", "build_compressor",
           "parse_compression", "method_names", "NoneCompressor", "FP16Compressor", "TopKCompressor",
           "RandomKCompressor", "RedSyncCompressor", "IWPCompressor", "SBCCompressor"]
