"""Generated datasets: deterministic from ``seed``, no files, any size.

* ``synthetic``: Gaussian class clusters.  Class means are random directions of norm
  ``separation``; a sample is its class mean plus unit Gaussian noise.  Two random means are
  ``~separation*sqrt(2)`` apart, so the default 3.0 gives a learnable but not trivial task
  (Bayes accuracy ~0.89 for 10 classes in any dimension; a logistic regression on 2048
  samples gets ~0.89 test accuracy at dim 20, ~0.8 at 64, less at 3072 where it overfits).
  ``input_shape`` may be an image shape like (1, 8, 8) (default, so every digits model runs
  on it) or a flat dim.
* ``synthetic_lm``: token stream from a random sparse Markov chain: every token has
  ``branching`` random successors with Dirichlet(1) probabilities.  The achievable
  perplexity is at most ``branching`` (vs. ``vocab_size`` for a uniform guess), so an LSTM
  visibly learns within a few hundred steps.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Optional, Union

import numpy as np
import torch

from .base import DataBundle, TensorPairDataset, shard_indices
from .text import lm_bundle


def build_synthetic(path: Optional[str], rank: int, size: int, seed: int, *,
                    num_samples: int = 2048, num_test: int = 512,
                    input_shape: Union[int, tuple] = (1, 8, 8), num_classes: int = 10,
                    separation: float = 3.0) -> DataBundle:
    """Gaussian-cluster classification; ``num_samples`` train + ``num_test`` test samples."""
    shape = (int(input_shape),) if isinstance(input_shape, int) else tuple(int(d) for d in input_shape)
    if num_classes < 2 or num_samples < 1 or num_test < 1 or min(shape) < 1:
        raise ValueError("synthetic needs num_classes >= 2, num_samples/num_test >= 1 and a "
                         f"positive input_shape, got {num_classes}, {num_samples}, {num_test}, {shape}")
    dim = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    means = rng.standard_normal((num_classes, dim))
    means *= separation / np.linalg.norm(means, axis=1, keepdims=True)
    total = num_samples + num_test
    y = rng.integers(0, num_classes, total)
    x = (means[y] + rng.standard_normal((total, dim))).astype(np.float32).reshape((total,) + shape)
    x_tr, y_tr, x_te, y_te = x[:num_samples], y[:num_samples], x[num_samples:], y[num_samples:]
    idx = shard_indices(num_samples, rank, size, seed)
    train = TensorPairDataset(torch.from_numpy(x_tr[idx]), torch.from_numpy(y_tr[idx]))
    test = TensorPairDataset(torch.from_numpy(x_te.copy()), torch.from_numpy(y_te.copy()))
    return DataBundle(train, test, int(num_classes), shape, "classification", "synthetic",
                      {"train_size_total": num_samples})


def markov_tokens(vocab_size: int, num_tokens: int, branching: int, seed: int) -> np.ndarray:
    """Sample ``num_tokens`` ids from a random sparse Markov chain fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, vocab_size, (vocab_size, branching)).tolist()
    cum = np.cumsum(rng.dirichlet(np.ones(branching), size=vocab_size), axis=1).tolist()
    u = rng.random(num_tokens).tolist()
    state, last = int(rng.integers(vocab_size)), branching - 1
    out = [0] * num_tokens
    for t in range(num_tokens):  # inherently sequential; ~1 us/token in pure Python
        state = succ[state][min(bisect_right(cum[state], u[t]), last)]
        out[t] = state
    return np.asarray(out, dtype=np.int64)


def build_synthetic_lm(path: Optional[str], rank: int, size: int, seed: int, *,
                       vocab_size: int = 1000, num_tokens: int = 100_000,
                       num_test_tokens: Optional[int] = None, seq_len: int = 35,
                       branching: int = 4) -> DataBundle:
    """Markov-chain LM corpus; test stream (default ``num_tokens // 10``) from the same chain."""
    if vocab_size < 2 or not 1 <= branching <= vocab_size:
        raise ValueError(f"synthetic_lm needs vocab_size >= 2 and 1 <= branching <= vocab_size, "
                         f"got {vocab_size}, {branching}")
    n_test = max(num_tokens // 10, seq_len + 1) if num_test_tokens is None else int(num_test_tokens)
    stream = markov_tokens(int(vocab_size), int(num_tokens) + n_test, int(branching), seed)
    return lm_bundle(stream[:num_tokens], stream[num_tokens:], vocab_size, seq_len, rank, size,
                     seed, "synthetic_lm", {"branching": branching})
