"""Small convolutional classifier for digits (1x8x8), MNIST (1x28x28) or CIFAR (3x32x32).

Layout: ``conv3x3(32w) -> ReLU -> maxpool2 -> conv3x3(64w) -> ReLU -> maxpool2 ->
fc(128w) -> ReLU -> fc(num_classes)`` where ``w`` is the ``width`` multiplier.  Pooling is
skipped once the feature map is 1 pixel wide, so tiny inputs still work.  Most parameters
live in the first FC layer (e.g. 3136x128 for MNIST), which is typical of the
"conv features + dense head" nets used in gradient-compression papers.
"""
from __future__ import annotations

import torch
from torch import nn


def _image_shape(input_shape: tuple, model: str) -> tuple[int, int, int]:
    """Normalise ``input_shape`` to (C, H, W); (H, W) means one channel."""
    shape = tuple(int(d) for d in input_shape)
    if len(shape) == 2:
        shape = (1,) + shape
    if len(shape) != 3:
        raise ValueError(f"model '{model}' needs an image input_shape (C, H, W), got {input_shape}; "
                         "use model 'mlp' for flat inputs")
    return shape  # type: ignore[return-value]


class SmallCNN(nn.Module):
    def __init__(self, input_shape: tuple, num_classes: int, width: float = 1):
        super().__init__()
        c, h, w = _image_shape(input_shape, "cnn")
        c1, c2, f = (max(1, int(round(k * width))) for k in (32, 64, 128))
        layers: list[nn.Module] = []
        for cin, cout in ((c, c1), (c1, c2)):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]
            if min(h, w) >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c2 * h * w, f), nn.ReLU(inplace=True), nn.Linear(f, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_cnn(num_classes: int, input_shape: tuple, *, width: float = 1) -> SmallCNN:
    """Build a :class:`SmallCNN`; ``width`` scales every layer's channel/unit count."""
    if width <= 0:
        raise ValueError(f"cnn option 'width' must be > 0, got {width}")
    return SmallCNN(input_shape, num_classes, width)
