from .adam import AdamUnitsMemory
from .momentum import MomentumCorrectionMemory
from .residual import NoMemory, ResidualMemory
from .state import Carried

__all__ = ["NoMemory", "ResidualMemory", "MomentumCorrectionMemory", "AdamUnitsMemory", "Carried"]
