"""Compressors by method name. Adding a method = a config class (config/compression.py) and a line here."""
from __future__ import annotations

from typing import Any

from ..config.compression import CompressionConfig, parse_compression
from .base import Compressor, Layer, Message
from .dense import FP16Compressor, NoneCompressor
from .exact_k import ExactKCompressor
from .iwp import IWPCompressor
from .powersgd import PowerSGDCompressor
from .qsgd import QSGDCompressor
from .redsync import RedSyncCompressor
from .sbc import SBCCompressor
from .signsgd import SignSGDCompressor
from .topk import RandomKCompressor, TopKCompressor

COMPRESSORS: dict[str, type] = {
    "none": NoneCompressor,
    "fp16": FP16Compressor,
    "topk": TopKCompressor,
    "randomk": RandomKCompressor,
    "redsync": RedSyncCompressor,
    "iwp": IWPCompressor,
    "sbc": SBCCompressor,
    # the incumbent baselines, behind the same API
    "powersgd": PowerSGDCompressor,
    "signsgd": SignSGDCompressor,
    "qsgd": QSGDCompressor,
}


def build_compressor(compression: Any, comm: Any = None) -> tuple[Compressor, CompressionConfig]:
    """dict / config / Compressor object -> (compressor, config). ``comm`` serves compressors that
    run collectives of their own (IWP's broadcast)."""
    if isinstance(compression, Compressor):
        cfg = compression.config if isinstance(compression.config, CompressionConfig) \
            else parse_compression({"method": "none"})
        if compression.comm is None:
            compression.comm = comm
        return compression, cfg
    cfg = parse_compression(compression if compression is not None else {"method": "none"})
    if cfg.method not in COMPRESSORS:
        raise ValueError(f"compression.method={cfg.method!r} is not a compressor; "
                         f"compressors: {sorted(COMPRESSORS)}")
    if cfg.method == "redsync" and cfg.selection.method == "radix":
        return ExactKCompressor(cfg, comm), cfg   # exactly k per layer of a bucket, on the device
    return COMPRESSORS[cfg.method](cfg, comm), cfg


__all__ = ["Compressor", "Layer", "Message", "COMPRESSORS", "build_compressor", "NoneCompressor",
           "FP16Compressor", "TopKCompressor", "ExactKCompressor", "RandomKCompressor", "RedSyncCompressor",
           "IWPCompressor", "SBCCompressor", "PowerSGDCompressor", "SignSGDCompressor", "QSGDCompressor"]
