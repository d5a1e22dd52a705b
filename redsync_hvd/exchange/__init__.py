"""The gradient exchange: compensate -> compress -> update memory -> send, then finish()."""
from .exchange import GradientExchange
from .nonfinite import NonFiniteGradientError

__all__ = ["GradientExchange", "NonFiniteGradientError"]
