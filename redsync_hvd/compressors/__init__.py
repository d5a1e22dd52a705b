"""Compressors (base.py's contract); which method runs which is declared once, in
``config/registry.py``."""
from __future__ import annotations

from typing import Any

from ..config import registry
from ..config.compression import CompressionConfig, parse_compression
from .base import Compressor, Layer, Message, Wire
from .dense import FP16Compressor, NoneCompressor
from .exact_k import ExactKCompressor
from .iwp import IWPCompressor
from .powersgd import PowerSGDCompressor
from .qsgd import QSGDCompressor
from .redsync import RedSyncCompressor
from .sbc import SBCCompressor
from .signsgd import SignSGDCompressor
from .topk import RandomKCompressor, TopKCompressor


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
    factory = registry.compressor_factory(cfg.method)
    if factory is None:
        raise ValueError(f"compression.method={cfg.method!r} {cfg.limits()}: it has no compressor; build it with "
                         "redsync_hvd.torch.DecentralizedOptimizer (DistributedOptimizer does so for you)")
    return factory(cfg, comm), cfg


__all__ = ["Compressor", "Layer", "Message", "Wire", "build_compressor", "NoneCompressor",
           "FP16Compressor", "TopKCompressor", "ExactKCompressor", "RandomKCompressor", "RedSyncCompressor",
           "IWPCompressor", "SBCCompressor", "PowerSGDCompressor", "SignSGDCompressor", "QSGDCompressor"]
