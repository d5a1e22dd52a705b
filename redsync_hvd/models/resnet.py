"""CIFAR ResNet-20 (He et al., 2016, "Deep Residual Learning", Sec. 4.2).

3 stages x 3 basic blocks with 16/32/64 channels (times ``base_width/16``), BatchNorm, global
average pooling and one FC layer: ~0.27M parameters at the default width.  Down-sampling
shortcuts use the paper's "option A" (stride-2 subsampling + zero-padding of the new
channels), so the shortcuts have no parameters, as in the original CIFAR experiments.
Global average pooling makes any spatial size >= 8 work, not only 32x32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .cnn import _image_shape


class _PadShortcut(nn.Module):
    """Option-A shortcut: subsample by 2 and zero-pad channels from ``cin`` to ``cout``."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.extra = cout - cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, ::2, ::2]
        return F.pad(x, (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = _PadShortcut(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetCifar(nn.Module):
    """ResNet-(6n+2) for CIFAR; ``blocks_per_stage=3`` gives ResNet-20."""

    def __init__(self, input_shape: tuple, num_classes: int, blocks_per_stage: int = 3,
                 base_width: int = 16):
        super().__init__()
        c, _, _ = _image_shape(input_shape, "resnet20")
        widths = [base_width, 2 * base_width, 4 * base_width]
        self.conv = nn.Conv2d(c, widths[0], 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        blocks: list[nn.Module] = []
        cin = widths[0]
        for stage, cout in enumerate(widths):
            for i in range(blocks_per_stage):
                stride = 2 if (stage > 0 and i == 0) else 1
                blocks.append(BasicBlock(cin, cout, stride))
                cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.conv(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


def build_resnet20(num_classes: int, input_shape: tuple, *, base_width: int = 16) -> ResNetCifar:
    """Build CIFAR ResNet-20; ``base_width`` (default 16) sets the first stage's channels."""
    if base_width <= 0:
        raise ValueError(f"resnet20 option 'base_width' must be > 0, got {base_width}")
    return ResNetCifar(input_shape, num_classes, blocks_per_stage=3, base_width=int(base_width))
