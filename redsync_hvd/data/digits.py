"""scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

Ships inside scikit-learn, so it needs no download and no ``path``: the default dataset for
smoke tests and CPU-only runs.  Pixels (0..16) are divided by 16 to lie in [0, 1] and
reshaped to (1, 8, 8) float32; labels are int64.  The train/test split is stratified and
seeded, so every rank computes the same split before taking its own train shard.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .base import DataBundle, TensorPairDataset, shard_indices


def build_digits(path: Optional[str], rank: int, size: int, seed: int, *,
                 test_fraction: float = 0.2) -> DataBundle:
    """Digits bundle; ``path`` is ignored (the data is bundled with scikit-learn)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits option 'test_fraction' must be in (0, 1), got {test_fraction}")
    raw = load_digits()
    x = (raw.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = raw.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                              stratify=y)
    idx = shard_indices(len(x_tr), rank, size, seed)
    train = TensorPairDataset(torch.from_numpy(x_tr[idx]), torch.from_numpy(y_tr[idx]))
    test = TensorPairDataset(torch.from_numpy(x_te), torch.from_numpy(y_te))
    return DataBundle(train, test, 10, (1, 8, 8), "classification", "digits",
                      {"train_size_total": len(x_tr)})
