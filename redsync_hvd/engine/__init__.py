"""The adapter core: what every framework adapter needs to run the exchange (build.py), and the
measurements the cost-model policy takes at start (probes.py)."""
from .build import (
                    NO_MOMENTS_NOTE,
                    NO_MOMENTUM_NOTE,
                    AdamSpec,
                    Built,
                    MomentumSpec,
                    UnsupportedMethodError,
                    build_exchange,
                    build_memory,
                    check_same_everywhere,
                    parse,
                    refuse,
                    refuse_average_variance,
)
from .probes import given_compute, network_for, probe_compute

__all__ = [
    "NO_MOMENTS_NOTE",
    "NO_MOMENTUM_NOTE",
    "AdamSpec",
    "Built",
    "MomentumSpec",
    "UnsupportedMethodError",
    "build_exchange",
    "build_memory",
    "check_same_everywhere",
    "given_compute",
    "network_for",
    "parse",
    "probe_compute",
    "refuse",
    "refuse_average_variance",
]
