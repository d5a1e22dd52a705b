"""Shared pieces of the data layer: :class:`DataBundle`, the in-memory dataset class, the
deterministic sharding rule and the "files are missing" error helper.

Sharding rule (identical on every rank, no communication needed): permute ``range(n)`` with
``numpy.random.default_rng(seed)``; rank ``r`` of ``size`` takes ``perm[r::size]`` cut to
``n // size`` items.  Shards are disjoint, equally sized (so every rank runs the same number
of steps per epoch and no collective waits forever), and their union is ``perm[:size*(n//size)]``;
the ``n % size`` leftover samples are dropped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

CACHE_ENV = "REDSYNC_DATA_CACHE"


def cache_dir() -> str:
    """Where scripts/install.sh unpacks the data sets it downloads, and where loaders keep what
    they derive once: ``$REDSYNC_DATA_CACHE``, by default ``~/.cache/redsync_hvd/data``."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "redsync_hvd", "data")


@dataclass
class DataBundle:
    """What :func:`redsync_hvd.data.build_datasets` returns.

    ``train`` holds only this rank's shard; ``test`` is the full test set (same on all ranks);
    ``num_classes`` is the vocabulary size when ``task == "lm"``; ``input_shape`` is the shape
    of one input sample (``(seq_len,)`` for LM).  ``info`` carries extras (full train size,
    vocabulary, ...).
    """

    train: Dataset
    test: Dataset
    num_classes: int
    input_shape: tuple
    task: str = "classification"
    name: str = ""
    info: dict = field(default_factory=dict)

    def record(self) -> dict:
        """What a run's summary.json says about its data: name, task, sizes, and the small entries
        of ``info`` (what identifies the data, e.g. pydoc's Python version and text hash); long
        lists such as a vocabulary are left out."""
        small = {k: v for k, v in self.info.items() if not (isinstance(v, (list, tuple)) and len(v) > 16)}
        return {"name": self.name, "task": self.task, "num_classes": int(self.num_classes),
                "input_shape": list(self.input_shape), "train_size": len(self.train), "test_size": len(self.test),
                **small}


class TensorPairDataset(Dataset):
    """``(inputs[i], targets[i])`` pairs held in memory, with an optional per-sample transform.

    Image data can stay ``uint8`` (4x less memory) and be normalised/augmented lazily by
    ``transform``.  ``.tensors`` mirrors ``TensorDataset`` for full-batch use (raw inputs).
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor,
                 transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        if len(inputs) != len(targets):
            raise ValueError(f"inputs ({len(inputs)}) and targets ({len(targets)}) differ in length")
        self.inputs, self.targets, self.transform = inputs, targets, transform

    @property
    def tensors(self) -> tuple:
        return self.inputs, self.targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i):
        x = self.inputs[i]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[i]


def shard_indices(n: int, rank: int, size: int, seed: int) -> np.ndarray:
    """Indices of rank ``rank``'s shard of ``range(n)`` (see the module docstring)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need size >= 1 and 0 <= rank < size, got rank={rank}, size={size}")
    per_rank = n // size
    if per_rank < 1:
        raise ValueError(f"cannot shard {n} training samples over {size} ranks")
    perm = np.random.default_rng(seed).permutation(n)
    return perm[rank::size][:per_rank]


def require_files(dataset: str, path: Optional[str], files: Sequence[str], fix: str,
                  alternatives: Optional[Sequence[Sequence[str]]] = None) -> list[str]:
    """Return the full paths of ``files`` under ``path`` or raise a helpful FileNotFoundError.

    ``alternatives[i]`` lists other accepted names for ``files[i]`` (e.g. a ``.gz`` variant);
    the first existing one wins.
    """
    expected = ", ".join(files)
    if path is None:
        raise FileNotFoundError(
            f"dataset '{dataset}' needs data.path (a folder containing: {expected}) but no path "
            f"was given. Fix: {fix}")
    found, missing = [], []
    for i, name in enumerate(files):
        names = [name] + list(alternatives[i] if alternatives else [])
        hits = [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]
        if hits:
            found.append(hits[0])
        else:
            missing.append(" or ".join(names))
    if missing:
        where = "does not exist" if not os.path.isdir(path) else "is missing " + "; ".join(missing)
        raise FileNotFoundError(
            f"dataset '{dataset}': looked in {os.path.abspath(path)!r}, which {where}. "
            f"Expected files: {expected}. Fix: {fix}")
    return found
