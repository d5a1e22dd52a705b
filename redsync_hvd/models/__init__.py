"""Reference models: ``build_model(name, num_classes, input_shape, **options)``.

All models are written here (no torchvision) so they are identical on every rank and every
install.  Initialisation only uses torch's global RNG, so ``torch.manual_seed(s)`` before
``build_model`` gives bit-identical weights (the trainer still broadcasts rank 0's weights).

========== ====================================== ==========================================
name       intended data                          options (defaults)
========== ====================================== ==========================================
mlp        digits (1x8x8, flattened)              hidden=[128, 128]
cnn        digits / MNIST / CIFAR                 width=1
resnet20   CIFAR-10 (3x32x32)                     base_width=16
vgg        CIFAR-10; fc_width=4096 -> comm-bound  depth=11, fc_width=512, batch_norm=True,
                                                  dropout=0.5, width=1.0
lstm_lm    PTB / synthetic_lm (num_classes=vocab) embed_dim=200, hidden=200, num_layers=2,
                                                  dropout=0.2, tie_weights=False, vocab_size
gpt        PTB / pydoc / synthetic_lm (vocab)     d_model=128, n_layers=2, n_heads=4, d_ff=4*d_model,
                                                  dropout=0.1, max_len=seq_len (input_shape[0])
========== ====================================== ==========================================
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict

from torch import nn

from .cnn import SmallCNN, build_cnn
from .gpt import GPT, build_gpt
from .lstm import LSTMLanguageModel, build_lstm_lm
from .mlp import MLP, build_mlp
from .resnet import ResNetCifar, build_resnet20
from .vgg import VGG, build_vgg

_BUILDERS: Dict[str, Callable[..., nn.Module]] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "resnet20": build_resnet20,
    "vgg": build_vgg,
    "lstm_lm": build_lstm_lm,
    "gpt": build_gpt,
}
MODEL_NAMES = tuple(_BUILDERS)


def model_options(name: str) -> Dict[str, object]:
    """The options ``name`` accepts, with their defaults."""
    sig = inspect.signature(_BUILDERS[name])
    return {p.name: p.default for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}


def build_model(name: str, num_classes: int, input_shape: tuple, **options) -> nn.Module:
    """Build reference model ``name`` for ``num_classes`` outputs and per-sample ``input_shape``.

    Raises ``ValueError`` for an unknown name and ``TypeError`` for an unknown option (both
    messages list the valid choices).
    """
    key = str(name).lower()
    if key not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODEL_NAMES)}")
    allowed = model_options(key)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for model {key!r}; "
                        f"valid options: {sorted(allowed) or 'none'}")
    if int(num_classes) < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return _BUILDERS[key](int(num_classes), tuple(input_shape), **options)


__all__ = ["build_model", "model_options", "MODEL_NAMES", "MLP", "SmallCNN", "ResNetCifar",
           "VGG", "LSTMLanguageModel", "GPT"]
