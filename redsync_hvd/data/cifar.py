"""CIFAR-10 from the official "python version" pickle batches (no download here).

Expects the extracted ``cifar-10-batches-py`` folder (``data_batch_1`` .. ``data_batch_5``,
``test_batch``); passing its parent folder also works.  Images stay ``uint8`` in memory
(150 MB for the full train set instead of 600 MB as float) and are normalised per sample by
:class:`ImageTransform` with the per-channel mean/std of the CIFAR-10 training set.  The
optional ``augment`` is the standard ResNet recipe: zero-pad 4, random 32x32 crop, random
horizontal flip (train only), drawn from torch's RNG so DataLoader workers seed it.
"""
from __future__ import annotations

import os
import pickle
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .base import DataBundle, TensorPairDataset, require_files, shard_indices

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch"
_FIX = ("download the CIFAR-10 python version (cifar-10-python.tar.gz from "
        "https://www.cs.toronto.edu/~kriz/cifar.html), extract it and pass "
        "data.path=/path/to/cifar-10-batches-py, or use data.name=digits (bundled, no download)")


class ImageTransform:
    """uint8 (C, H, W) -> normalised float32, with optional pad-crop + flip augmentation.

    A plain class (not a lambda) so datasets stay picklable for multi-worker DataLoaders.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], augment: bool = False,
                 pad: int = 4):
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self.augment, self.pad = augment, pad

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        x = img.float().div_(255.0)
        if self.augment:
            _, h, w = x.shape
            x = F.pad(x, (self.pad,) * 4)  # zero (black) padding, as torchvision RandomCrop
            i, j = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
            x = x[:, i:i + h, j:j + w]
            if torch.rand(()) < 0.5:
                x = x.flip(-1)
        return (x - self.mean) / self.std


def load_cifar_batch(file: str) -> tuple[np.ndarray, np.ndarray]:
    """Read one pickle batch -> (uint8 [N, 3, 32, 32], int64 [N])."""
    with open(file, "rb") as f:
        d = pickle.load(f, encoding="bytes")
    data = d.get(b"data", d.get("data")) if isinstance(d, dict) else None
    labels = d.get(b"labels", d.get("labels")) if isinstance(d, dict) else None
    if data is None or labels is None:
        raise ValueError(f"{file} is not a CIFAR-10 python batch (no 'data'/'labels' entries)")
    data = np.asarray(data, dtype=np.uint8).reshape(-1, 3, 32, 32)
    return data, np.asarray(labels, dtype=np.int64)


def build_cifar10(path: Optional[str], rank: int, size: int, seed: int, *,
                  augment: bool = False) -> DataBundle:
    """CIFAR-10 bundle: this rank's shard of the 50k train images, all 10k test images."""
    files = CIFAR10_TRAIN_FILES + (CIFAR10_TEST_FILE,)
    if path is not None and not os.path.isfile(os.path.join(path, files[0])):
        nested = os.path.join(path, "cifar-10-batches-py")  # user passed the parent folder
        if os.path.isfile(os.path.join(nested, files[0])):
            path = nested
    found = require_files("cifar10", path, files, _FIX)
    parts = [load_cifar_batch(f) for f in found[:-1]]
    x_tr = np.concatenate([p[0] for p in parts])
    y_tr = np.concatenate([p[1] for p in parts])
    x_te, y_te = load_cifar_batch(found[-1])
    n_total = len(x_tr)
    idx = shard_indices(n_total, rank, size, seed)
    x_tr, y_tr = np.ascontiguousarray(x_tr[idx]), y_tr[idx]  # drop the other ranks' images
    train = TensorPairDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr),
                              ImageTransform(CIFAR10_MEAN, CIFAR10_STD, augment=bool(augment)))
    test = TensorPairDataset(torch.from_numpy(x_te), torch.from_numpy(y_te),
                             ImageTransform(CIFAR10_MEAN, CIFAR10_STD, augment=False))
    return DataBundle(train, test, 10, (3, 32, 32), "classification", "cifar10",
                      {"train_size_total": n_total, "path": path})
