from .adam import AdamUnitsMemory
from .momentum import MomentumCorrectionMemory
from .residual import NoMemory, ResidualMemory

__all__ = ["NoMemory", "ResidualMemory", "MomentumCorrectionMemory", "AdamUnitsMemory"]
