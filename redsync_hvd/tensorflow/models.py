"""Keras twins of the reference torch models (``mlp``, ``cnn``), with the torch model's weights.

``build_keras_model(name, num_classes, input_shape, seed, **options)`` builds the torch model
with :func:`redsync_hvd.models.build_model` (so the architecture, options and the seeded
initialisation are the torch ones) and translates it layer by layer into a Keras model for
channels-last input (``N, H, W, C``), copying the weights. Both frameworks therefore start
from the same function. The returned ``named_variables`` use the torch parameter names
(``features.0.weight``, ``classifier.3.bias``...), so per-layer overrides, policy decisions
and statistics read the same in both.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
import torch
from torch import nn

SUPPORTED = ("mlp", "cnn")


def build_keras_model(name: str, num_classes: int, input_shape: tuple, seed: int = 0, **options):
    """Returns (keras_model, named_variables [(torch name, tf.Variable)], channels_last_input_shape)."""
    from ..models import build_model
    if str(name).lower() not in SUPPORTED:
        raise ValueError(f"framework: tensorflow supports the models {list(SUPPORTED)}, got {name!r}; "
                         "use framework: torch for the others")
    torch.manual_seed(seed)
    tmodel = build_model(name, num_classes, input_shape, **options)
    shape = tuple(int(d) for d in input_shape)
    if len(shape) == 2:
        shape = (1,) + shape
    nhwc = (shape[1], shape[2], shape[0]) if len(shape) == 3 else shape
    return translate(tmodel, nhwc)


def translate(tmodel: nn.Module, nhwc_shape: tuple):
    """A sequential torch model of Conv2d / Linear / ReLU / MaxPool2d / Flatten leaves -> Keras."""
    inputs = tf.keras.Input(shape=nhwc_shape)
    x = inputs
    named, copies = [], []
    for mod_name, mod in tmodel.named_modules():
        if list(mod.children()):
            continue
        if isinstance(mod, nn.Conv2d):
            if mod.groups != 1 or mod.dilation != (1, 1) or mod.padding_mode != "zeros":
                raise ValueError(f"{mod_name}: only plain convolutions translate to Keras")
            if any(mod.padding):
                x = tf.keras.layers.ZeroPadding2D(mod.padding)(x)
            layer = tf.keras.layers.Conv2D(mod.out_channels, mod.kernel_size, strides=mod.stride,
                                           padding="valid", use_bias=mod.bias is not None)
            x = layer(x)
            copies.append((layer, mod_name, mod.weight.detach().numpy().transpose(2, 3, 1, 0), mod.bias))
        elif isinstance(mod, nn.Linear):
            layer = tf.keras.layers.Dense(mod.out_features, use_bias=mod.bias is not None)
            x = layer(x)
            copies.append((layer, mod_name, mod.weight.detach().numpy().T, mod.bias))
        elif isinstance(mod, nn.ReLU):
            x = tf.keras.layers.ReLU()(x)
        elif isinstance(mod, nn.MaxPool2d):
            stride = mod.stride if mod.stride is not None else mod.kernel_size
            x = tf.keras.layers.MaxPool2D(mod.kernel_size, strides=stride, padding="valid")(x)
        elif isinstance(mod, nn.Flatten):
            if len(x.shape) == 4:   # flatten in torch's (C, H, W) order so FC weights copy as they are
                x = tf.keras.layers.Permute((3, 1, 2))(x)
            x = tf.keras.layers.Flatten()(x)
        else:
            raise ValueError(f"{mod_name}: {type(mod).__name__} has no Keras translation here")
    model = tf.keras.Model(inputs, x)
    for layer, mod_name, kernel, bias in copies:
        layer.kernel.assign(np.ascontiguousarray(kernel))
        named.append((f"{mod_name}.weight", layer.kernel))
        if bias is not None:
            layer.bias.assign(bias.detach().numpy())
            named.append((f"{mod_name}.bias", layer.bias))
    order = {id(v): i for i, v in enumerate(model.trainable_variables)}
    named.sort(key=lambda nv: order[id(nv[1])])
    return model, named, nhwc_shape
