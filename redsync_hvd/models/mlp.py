"""Fully-connected classifier (the default model for the bundled ``digits`` data).

The input is flattened, so any ``input_shape`` works; for digits (1, 8, 8) that is 64
features.  With the default ``hidden=[128, 128]`` the net has ~26k parameters: tiny enough
for fast CPU tests, big enough to fit digits to >0.9 accuracy in a few seconds.
"""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch
from torch import nn


class MLP(nn.Module):
    """``Flatten -> [Linear -> ReLU] * len(hidden) -> Linear(num_classes)``."""

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int] = (128, 128)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        prev = in_features
        for width in hidden:
            layers += [nn.Linear(prev, int(width)), nn.ReLU(inplace=True)]
            prev = int(width)
        layers.append(nn.Linear(prev, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_mlp(num_classes: int, input_shape: tuple, *,
              hidden: Union[int, Sequence[int]] = (128, 128)) -> MLP:
    """Build an :class:`MLP`; ``hidden`` is a list of layer widths (an int means one layer)."""
    if isinstance(hidden, int):
        hidden = [hidden]
    hidden = list(hidden)
    if any(int(h) <= 0 for h in hidden):
        raise ValueError(f"mlp option 'hidden' must be positive widths, got {hidden}")
    in_features = int(math.prod(int(d) for d in input_shape))
    return MLP(in_features, num_classes, hidden)
