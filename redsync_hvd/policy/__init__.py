"""Which layers compress and at what density (layers.py), decided with the alpha-beta cost
model of collectives (costmodel.py) where ``policy.mode: cost_model``."""
from .costmodel import ComputeModel, Network, probe_network
from .layers import LayerPolicy

__all__ = ["ComputeModel", "LayerPolicy", "Network", "probe_network"]
