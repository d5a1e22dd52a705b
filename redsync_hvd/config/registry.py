"""Every method, declared once: its name, its config (the YAML schema of ``compression:``) and what
runs it.

A line ties a method's name to two classes, named as ``module:attribute`` under ``redsync_hvd``:
the pydantic model of its config section (knobs, defaults, validation, the capabilities the
engines read: ``frameworks``, ``engines``, ``strategy``, ``delayed``) and its compressor
(``compressors/base.py``: what it sends, how it decodes, and its ``wire`` cost, which the cost
model and the byte budget read), or a function building one from the config. The decentralized
methods run outside the gradient exchange (``redsync_hvd.decentralized``): no compressor.

Adding a compressor is one file with its config and its compressor, and one line here
(docs/extending.md). Modules are imported when a method is first asked for, so this table can
name a compressor (a layer above config) without the config layer importing it.
"""
from __future__ import annotations

import importlib

METHODS: dict[str, tuple[str, str | None]] = {
    "none": ("config.compression:NoneConfig", "compressors.dense:NoneCompressor"),
    "fp16": ("config.compression:FP16Config", "compressors.dense:FP16Compressor"),
    "topk": ("config.compression:TopKConfig", "compressors.topk:TopKCompressor"),
    "randomk": ("config.compression:RandomKConfig", "compressors.topk:RandomKCompressor"),
    "redsync": ("config.compression:RedSyncConfig", "compressors.redsync:build"),
    "iwp": ("config.compression:IWPConfig", "compressors.iwp:IWPCompressor"),
    "sbc": ("config.compression:SBCConfig", "compressors.sbc:SBCCompressor"),
    "powersgd": ("config.baselines:PowerSGDConfig", "compressors.powersgd:PowerSGDCompressor"),
    "signsgd": ("config.baselines:SignSGDConfig", "compressors.signsgd:SignSGDCompressor"),
    "qsgd": ("config.baselines:QSGDConfig", "compressors.qsgd:QSGDCompressor"),
    "threshold": ("compressors.threshold:ThresholdConfig", "compressors.threshold:ThresholdCompressor"),
    "dct": ("compressors.dct:DCTConfig", "compressors.dct:DCTCompressor"),
    "dcd": ("config.compression:DecentralizedConfig", None),
    "ecd": ("config.compression:DecentralizedConfig", None),
    "dpsgd": ("config.compression:DecentralizedConfig", None),
    "naive": ("config.compression:DecentralizedConfig", None),
}


def _load(path: str):
    module, attribute = path.split(":")
    return getattr(importlib.import_module(f"redsync_hvd.{module}"), attribute)


def method_names() -> list[str]:
    return sorted(METHODS)


def config_class(name: str) -> type:
    """The config model of ``name`` (a KeyError for an unknown name)."""
    return _load(METHODS[name][0])


def compressor_factory(name: str):
    """What builds ``name``'s compressor from (config, communicator), or None (decentralized)."""
    path = METHODS[name][1]
    return None if path is None else _load(path)
