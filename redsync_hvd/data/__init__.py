"""Datasets: ``build_datasets(name, *, path=None, rank=0, size=1, seed=0, **options)``.

Every rank calls this with the same ``name``/``path``/``seed`` and its own ``rank``; it gets
back a :class:`DataBundle` whose ``train`` is only its own equal-sized, disjoint shard (see
:func:`shard_indices`) and whose ``test`` is the full test set.  Nothing is ever downloaded:
real datasets are read from ``path`` (fashion_mnist and austen: from where Debian's packages put
them, unless ``path`` is given) and a missing folder/file raises ``FileNotFoundError`` that names
the files expected and how to fix it.

============== ============================================ =====================================
name           source                                       options (defaults)
============== ============================================ =====================================
digits         scikit-learn bundled 8x8 digits (default)    test_fraction=0.2
synthetic      Gaussian class clusters                      num_samples=2048, num_test=512,
                                                            input_shape=(1,8,8), num_classes=10,
                                                            separation=3.0
synthetic_lm   random sparse Markov-chain tokens (task lm)  vocab_size=1000, num_tokens=100000,
                                                            num_test_tokens=None, seq_len=35,
                                                            branching=4
cifar10        path/ data_batch_1..5, test_batch (pickle)   augment=False
mnist          path/ {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]  normalize=True
fashion_mnist  Fashion-MNIST in MNIST's files; path defaults normalize=True
               to Debian's /usr/share/datasets/fashion-mnist/
ptb            path/ ptb.train.txt + ptb.valid/test.txt     seq_len=35, eval_split="auto"
pydoc          CPython's pydoc_data.topics (no download,    level="word" (or "char"), seq_len=35,
               a fixed split by topic; task lm)             min_count=2, eval_split="test"
austen         Jane Austen's six novels (Debian's           seq_len=35, min_count=2,
               r-cran-janeaustenr, unpacked by              eval_split="test"
               scripts/install.sh; split by chapter; lm)
============== ============================================ =====================================
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, Optional

from .austen import build_austen
from .base import DataBundle, TensorPairDataset, shard_indices
from .cifar import build_cifar10
from .digits import build_digits
from .fashion import build_fashion_mnist
from .mnist import build_mnist
from .pydoc import build_pydoc
from .synthetic import build_synthetic, build_synthetic_lm
from .text import build_ptb

_BUILDERS: Dict[str, Callable[..., DataBundle]] = {
    "digits": build_digits,
    "synthetic": build_synthetic,
    "synthetic_lm": build_synthetic_lm,
    "cifar10": build_cifar10,
    "mnist": build_mnist,
    "fashion_mnist": build_fashion_mnist,
    "ptb": build_ptb,
    "pydoc": build_pydoc,
    "austen": build_austen,
}
DATASET_NAMES = tuple(_BUILDERS)


def dataset_options(name: str) -> Dict[str, object]:
    """The options dataset ``name`` accepts, with their defaults."""
    sig = inspect.signature(_BUILDERS[name])
    return {p.name: p.default for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY}


def build_datasets(name: str = "digits", *, path: Optional[str] = None, rank: int = 0,
                   size: int = 1, seed: int = 0, **options) -> DataBundle:
    """Load dataset ``name`` and return this rank's :class:`DataBundle` (see module doc).

    Raises ``ValueError`` for an unknown name or bad rank/size, ``TypeError`` for an unknown
    option, and ``FileNotFoundError`` when a file-backed dataset's files are missing.
    """
    key = str(name).lower()
    if key not in _BUILDERS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {', '.join(DATASET_NAMES)}")
    allowed = dataset_options(key)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for dataset {key!r}; "
                        f"valid options: {sorted(allowed)}")
    size, rank = int(size), int(rank)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need size >= 1 and 0 <= rank < size, got rank={rank}, size={size}")
    return _BUILDERS[key](path, rank, size, int(seed), **options)


__all__ = ["build_datasets", "dataset_options", "DataBundle", "TensorPairDataset",
           "shard_indices", "DATASET_NAMES"]
