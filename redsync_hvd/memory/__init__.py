from .residual import ResidualMemory

__all__ = ["ResidualMemory"]
