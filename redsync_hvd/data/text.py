"""Word-level Penn Treebank (Mikolov's ``ptb.*.txt`` files) and LM windowing helpers.

Vocabulary: words of ``ptb.train.txt`` in first-appearance order, with ``<eos>`` appended to
every line (the PyTorch word_language_model convention); ``<unk>`` (already in PTB) is added
if absent and used for eval words missing from train.  The token stream is cut into
non-overlapping windows: sample ``i`` is ``(ids[iT : iT+T], ids[iT+1 : iT+T+1])`` with
``T = seq_len``, so every sample is independent and can be sharded like images (the LSTM
starts each window from a zero state; no hidden state is carried between batches).
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from .base import DataBundle, TensorPairDataset, require_files, shard_indices

EOS, UNK = "<eos>", "<unk>"
_FIX = ("download the Penn Treebank word-level files (ptb.train.txt, ptb.valid.txt, "
        "ptb.test.txt; e.g. from the simple-examples.tgz of Mikolov's RNNLM toolkit, "
        "folder data/) and pass data.path=/path/to/that/folder, "
        "or use data.name=synthetic_lm (generated, no download)")


def make_windows(ids: np.ndarray, seq_len: int, what: str = "corpus") -> tuple:
    """Cut a 1-d token stream into (inputs [n, T], targets [n, T]) int64 tensors."""
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise ValueError(f"{what} has {len(ids)} tokens: too few for one window of "
                         f"seq_len={seq_len} (needs seq_len + 1)")
    ids = np.asarray(ids, dtype=np.int64)
    inputs = ids[:n * seq_len].reshape(n, seq_len)
    targets = ids[1:n * seq_len + 1].reshape(n, seq_len)
    return torch.from_numpy(inputs.copy()), torch.from_numpy(targets.copy())


def lm_bundle(train_ids: np.ndarray, test_ids: np.ndarray, vocab_size: int, seq_len: int,
              rank: int, size: int, seed: int, name: str, info: dict) -> DataBundle:
    """Window both streams, shard the train windows, and wrap everything in a DataBundle."""
    if seq_len < 1:
        raise ValueError(f"{name} option 'seq_len' must be >= 1, got {seq_len}")
    x_tr, y_tr = make_windows(train_ids, seq_len, f"{name} train split")
    x_te, y_te = make_windows(test_ids, seq_len, f"{name} eval split")
    idx = torch.from_numpy(shard_indices(len(x_tr), rank, size, seed))
    info = dict(info, train_size_total=len(x_tr))
    return DataBundle(TensorPairDataset(x_tr[idx], y_tr[idx]), TensorPairDataset(x_te, y_te),
                      int(vocab_size), (int(seq_len),), "lm", name, info)


def read_words(file: str) -> list[str]:
    """All whitespace-separated words of ``file`` with ``<eos>`` after each line."""
    words: list[str] = []
    with open(file, encoding="utf-8") as f:
        for line in f:
            words.extend(line.split())
            words.append(EOS)
    return words


def build_ptb(path: Optional[str], rank: int, size: int, seed: int, *, seq_len: int = 35,
              eval_split: str = "auto") -> DataBundle:
    """PTB bundle. ``eval_split``: "valid", "test", or "auto" (valid if present, else test)."""
    if eval_split not in ("auto", "valid", "test"):
        raise ValueError(f"ptb option 'eval_split' must be 'auto', 'valid' or 'test', "
                         f"got {eval_split!r}")
    if eval_split == "auto":
        has_valid = path is not None and os.path.isfile(os.path.join(path, "ptb.valid.txt"))
        eval_split = "valid" if has_valid else "test"
    train_file, eval_file = require_files("ptb", path, ["ptb.train.txt", f"ptb.{eval_split}.txt"],
                                          _FIX)
    train_words = read_words(train_file)
    itos = list(dict.fromkeys(train_words))
    if UNK not in itos:
        itos.append(UNK)
    stoi = {w: i for i, w in enumerate(itos)}
    unk = stoi[UNK]
    train_ids = np.fromiter((stoi[w] for w in train_words), dtype=np.int64)
    test_ids = np.fromiter((stoi.get(w, unk) for w in read_words(eval_file)), dtype=np.int64)
    return lm_bundle(train_ids, test_ids, len(itos), seq_len, rank, size, seed, "ptb",
                     {"vocab": itos, "eval_split": eval_split, "path": path})
