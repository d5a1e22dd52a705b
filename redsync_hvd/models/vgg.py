"""VGG-style network for CIFAR-sized images (Simonyan & Zisserman, 2015).

A VGG-11/13/16/19 conv stack (optionally with BatchNorm) followed by the classic three-layer
FC head ``Linear(fc_width) -> ReLU -> Dropout -> Linear(fc_width) -> ReLU -> Dropout ->
Linear(num_classes)``.  With ``fc_width=4096`` the head alone holds ~19M parameters while
its FLOPs are tiny, i.e. the model is communication-bound: the setting where gradient
compression (RedSync etc.) pays off.  Max-pools are skipped once the feature map is 1 pixel,
so small inputs (digits 8x8) work too.  ``width`` scales conv channels (for fast tests).
"""
from __future__ import annotations

import torch
from torch import nn

from .cnn import _image_shape

VGG_CONFIGS = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(self, input_shape: tuple, num_classes: int, depth: int = 11, fc_width: int = 512,
                 batch_norm: bool = True, dropout: float = 0.5, width: float = 1.0):
        super().__init__()
        c, h, w = _image_shape(input_shape, "vgg")
        layers: list[nn.Module] = []
        cin = c
        for item in VGG_CONFIGS[depth]:
            if item == "M":
                if min(h, w) >= 2:
                    layers.append(nn.MaxPool2d(2))
                    h, w = h // 2, w // 2
                continue
            cout = max(1, int(round(int(item) * width)))
            layers.append(nn.Conv2d(cin, cout, 3, padding=1, bias=not batch_norm))
            if batch_norm:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.ReLU(inplace=True))
            cin = cout
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(cin * h * w, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(fc_width, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(fc_width, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build_vgg(num_classes: int, input_shape: tuple, *, depth: int = 11, fc_width: int = 512,
              batch_norm: bool = True, dropout: float = 0.5, width: float = 1.0) -> VGG:
    """Build a :class:`VGG`. ``depth`` in {11, 13, 16, 19}; ``fc_width=4096`` = original head."""
    if depth not in VGG_CONFIGS:
        raise ValueError(f"vgg option 'depth' must be one of {sorted(VGG_CONFIGS)}, got {depth}")
    if fc_width <= 0 or width <= 0:
        raise ValueError(f"vgg options 'fc_width' and 'width' must be > 0, got {fc_width}, {width}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"vgg option 'dropout' must be in [0, 1), got {dropout}")
    return VGG(input_shape, num_classes, int(depth), int(fc_width), bool(batch_norm),
               float(dropout), float(width))
