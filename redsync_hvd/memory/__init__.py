from .momentum import MomentumCorrectionMemory
from .residual import ResidualMemory

__all__ = ["ResidualMemory", "MomentumCorrectionMemory"]
