"""Layer shapes of the models the scaling projection prices (``costmodel.project_speedup``),
from the architectures' definitions: one entry per parameter tensor, in registration order."""
from __future__ import annotations


def _conv(cin, cout, k, bias=True):
    return [cout * cin * k * k] + ([cout] if bias else [])


def _alexnet():  # torchvision AlexNet (one-tower Krizhevsky 2014 variant), ~61.1M
    convs = [(3, 64, 11), (64, 192, 5), (192, 384, 3), (384, 256, 3), (256, 256, 3)]
    fcs = [(256 * 6 * 6, 4096), (4096, 4096), (4096, 1000)]
    return [x for c in convs for x in _conv(*c)] + [x for i, o in fcs for x in (o * i, o)]


def _vgg16():  # Simonyan & Zisserman configuration D, ~138.4M
    cfg = [3, 64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    fcs = [(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)]
    return [x for i, o in zip(cfg, cfg[1:]) for x in _conv(i, o, 3)] + [
        x for i, o in fcs for x in (o * i, o)]


def _resnet50():  # He et al. 2016 bottleneck [3, 4, 6, 3]; BN weight+bias, ~25.6M
    bn = lambda c: [c, c]  # noqa: E731
    layers, cin = _conv(3, 64, 7, False) + bn(64), 64
    for width, blocks in [(64, 3), (128, 4), (256, 6), (512, 3)]:
        for b in range(blocks):
            layers += _conv(cin, width, 1, False) + bn(width)
            layers += _conv(width, width, 3, False) + bn(width)
            layers += _conv(width, 4 * width, 1, False) + bn(4 * width)
            if b == 0:
                layers += _conv(cin, 4 * width, 1, False) + bn(4 * width)
            cin = 4 * width
    return layers + [1000 * 2048, 1000]


def _lstm_lm(vocab=10000, h=1500, nlayers=2):  # PTB "large" LM, ~66M
    lstm = [4 * h * h, 4 * h * h, 4 * h, 4 * h] * nlayers  # PyTorch: W_ih, W_hh, b_ih, b_hh
    return [vocab * h] + lstm + [vocab * h, vocab]  # embedding, LSTMs, softmax


#: {model: [numel of each parameter tensor]}, from the architectures' definitions.
PAPER_MODELS = {"alexnet": _alexnet(), "vgg16": _vgg16(), "resnet50": _resnet50(),
                "lstm_lm": _lstm_lm()}
