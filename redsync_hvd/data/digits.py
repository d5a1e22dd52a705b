"""scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

Ships inside scikit-learn, so it needs no download and no ``path``: the default dataset for
smoke tests and CPU-only runs.  Pixels (0..16) are divided by 16 to lie in [0, 1] and
reshaped to (1, 8, 8) float32; labels are int64.  The train/test split is stratified and
seeded, so every rank computes the same split before taking its own train shard.

Importing scikit-learn costs a process about 3 s (it imports scipy.stats), more than a short
run's training on the 2-core VM, and every worker of every launch paid it. The split is therefore
kept, once computed, in the data cache (``$REDSYNC_DATA_CACHE``, ``data/base.py``) under the
seed, the fraction and scikit-learn's version: later launches read it with numpy alone. A file
that cannot be read is computed again and replaced.
"""
from __future__ import annotations

import os
import tempfile
import zipfile
from contextlib import suppress
from importlib.metadata import version
from typing import Optional

import numpy as np
import torch

from .base import DataBundle, TensorPairDataset, cache_dir, shard_indices

PARTS = ("x_train", "x_test", "y_train", "y_test")


def split(seed: int, test_fraction: float) -> tuple:
    """(x_train, x_test, y_train, y_test) as scikit-learn's stratified split gives them: read from
    the cache where it holds them, else computed and saved there (atomically: the ranks of a launch
    may write it at once)."""
    path = os.path.join(cache_dir(), f"digits-sklearn{version('scikit-learn')}-seed{seed}-test{test_fraction!r}.npz")
    try:
        with np.load(path) as saved:
            return tuple(saved[k] for k in PARTS)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        pass                                            # absent or unreadable: compute it
    parts = _sklearn_split(seed, test_fraction)
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), suffix=".npz", delete=False) as tmp:
            np.savez(tmp, **dict(zip(PARTS, parts)))
        os.replace(tmp.name, path)
    except OSError:                                     # a read-only or full cache costs the next launch time only
        if tmp is not None:
            with suppress(OSError):
                os.unlink(tmp.name)
    return parts


def _sklearn_split(seed: int, test_fraction: float) -> tuple:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    x = (raw.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = raw.target.astype(np.int64)
    return tuple(train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y))


def build_digits(path: Optional[str], rank: int, size: int, seed: int, *,
                 test_fraction: float = 0.2) -> DataBundle:
    """Digits bundle; ``path`` is ignored (the data is bundled with scikit-learn)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits option 'test_fraction' must be in (0, 1), got {test_fraction}")
    x_tr, x_te, y_tr, y_te = split(seed, test_fraction)
    idx = shard_indices(len(x_tr), rank, size, seed)
    train = TensorPairDataset(torch.from_numpy(x_tr[idx]), torch.from_numpy(y_tr[idx]))
    test = TensorPairDataset(torch.from_numpy(x_te), torch.from_numpy(y_te))
    return DataBundle(train, test, 10, (1, 8, 8), "classification", "digits",
                      {"train_size_total": len(x_tr)})
