"""Configuration: the YAML experiment schema (run.py) and the compression schema (compression.py)."""
from . import baselines  # noqa: F401  (registers powersgd, signsgd, qsgd)
from .compression import CompressionConfig, MethodConfig, exchange_every, method_names, parse_compression
from .run import ConfigError, RunConfig, apply_overrides, load_config, read_yaml, validate

__all__ = ["CompressionConfig", "ConfigError", "MethodConfig", "RunConfig", "apply_overrides", "load_config",
           "exchange_every", "method_names", "parse_compression", "read_yaml", "validate"]
