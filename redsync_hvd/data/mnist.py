"""MNIST from the original idx files (plain or ``.gz``), no download here.

idx format: big-endian header ``0x00 0x00 <dtype=0x08 ubyte> <ndim>`` (so the magic number
is 2051 for the 3-d image files and 2049 for the 1-d label files), then ``ndim`` uint32
sizes, then the raw bytes.  Images stay uint8 in memory and are scaled to [0, 1] and
normalised with the usual MNIST mean/std (0.1307, 0.3081) per sample; shape (1, 28, 28).
"""
from __future__ import annotations

import gzip
import struct
from typing import Optional

import numpy as np
import torch

from .base import DataBundle, TensorPairDataset, require_files, shard_indices
from .cifar import ImageTransform

MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
_FIX = ("download the four MNIST idx files (e.g. from https://yann.lecun.com/exdb/mnist/ or a "
        "mirror; .gz files are fine) into one folder and pass data.path=/path/to/that/folder, "
        "or use data.name=digits (bundled, no download)")
IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC = 2051, 2049


def read_idx(file: str, expected_magic: int) -> np.ndarray:
    """Parse a uint8 idx file (optionally gzipped) into an array of its declared shape."""
    opener = gzip.open if file.endswith(".gz") else open
    with opener(file, "rb") as f:
        raw = f.read()
    (magic,) = struct.unpack(">I", raw[:4])
    if magic != expected_magic:
        raise ValueError(f"{file}: bad idx magic number {magic}, expected {expected_magic}")
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{file}: header says shape {dims} but holds {data.size} bytes")
    return data.reshape(dims)


def build_mnist(path: Optional[str], rank: int, size: int, seed: int, *,
                normalize: bool = True) -> DataBundle:
    """MNIST bundle: this rank's shard of the 60k train images, all 10k test images."""
    return idx_bundle("mnist", path, rank, size, seed, (MNIST_MEAN, MNIST_STD) if normalize else None, _FIX)


def idx_bundle(dataset: str, path: Optional[str], rank: int, size: int, seed: int,
               stats: Optional[tuple], fix: str, info: Optional[dict] = None) -> DataBundle:
    """A bundle from MNIST's four idx files under ``path`` (Fashion-MNIST has the same layout):
    this rank's shard of the train images, every test image, normalised by ``stats`` = (mean,
    std) per sample (``None``: only scaled to [0, 1]). ``fix`` ends the error for missing files."""
    found = require_files(dataset, path, MNIST_FILES, fix, alternatives=[[f + ".gz"] for f in MNIST_FILES])
    x_tr = read_idx(found[0], IDX_IMAGES_MAGIC)
    y_tr = read_idx(found[1], IDX_LABELS_MAGIC).astype(np.int64)
    x_te = read_idx(found[2], IDX_IMAGES_MAGIC)
    y_te = read_idx(found[3], IDX_LABELS_MAGIC).astype(np.int64)
    for x, y, f in ((x_tr, y_tr, found[0]), (x_te, y_te, found[2])):
        if len(x) != len(y):
            raise ValueError(f"{f}: {len(x)} images but {len(y)} labels")
    mean, std = stats if stats is not None else ((0.0,), (1.0,))
    transform = ImageTransform(mean, std)
    idx = shard_indices(len(x_tr), rank, size, seed)
    shard = x_tr[idx][:, None]  # (n, 1, 28, 28); fancy indexing copies, freeing the rest
    train = TensorPairDataset(torch.from_numpy(shard), torch.from_numpy(y_tr[idx]), transform)
    test = TensorPairDataset(torch.from_numpy(x_te[:, None].copy()),
                             torch.from_numpy(y_te), transform)
    h, w = x_tr.shape[1:]
    return DataBundle(train, test, 10, (1, int(h), int(w)), "classification", dataset,
                      {"train_size_total": len(x_tr), "path": path, **(info or {})})
