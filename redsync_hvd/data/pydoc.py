"""Real English text that ships with CPython: the reference topics of ``pydoc_data.topics``.

``help("assert")`` prints one of these 79 topics (about 465K characters of the language
reference). No download, no ``path``: every machine that runs Python has them.

**Split (fixed, by topic).** A topic whose ``sha256(name)`` is 0 mod 10 is in ``test``, 1 mod
10 in ``valid``, every other topic in ``train``; so no topic is in two splits and the split
does not depend on the seed, the Python version or the order of the topics. ``eval_split``
chooses what the runner evaluates on (``test`` by default; ``valid`` for tuning).

**Words** (``level: word``, the default), PTB's conventions (redsync_hvd/data/text.py): the
text is lower-cased; a line is a sentence ending in ``<eos>``; blank lines and reStructuredText
decoration (lines of only ``*=-~^+|_`` and spaces: title underlines, table borders) are
dropped; a token is a word (``[a-z_][a-z0-9_]*``), a number (written ``N``, as PTB does) or
one punctuation character. The vocabulary is the train split's tokens seen at least
``min_count`` times, in first-appearance order, then ``<unk>``: every rarer train token and
every unseen eval token is ``<unk>``, so the model meets ``<unk>`` in training as it does in PTB.
**Characters** (``level: char``): the same lines, case kept, one token per character, ``<eos>``
per line, the same ``min_count`` rule. Windows: ``make_windows`` (non-overlapping, ``seq_len``).

Sizes on CPython 3.11.7 (``REFERENCE``: text sha256 6c7d68ce...), with the defaults:

===== ====== =============== =================
split topics word tokens     character tokens
===== ====== =============== =================
train 64     88,079          373,136
valid 5      7,140           28,688
test  10     10,814          43,932
===== ====== =============== =================

Vocabulary (``min_count: 2``): 2,307 words with ``<unk>`` (``<unk>`` is 1.0% of train and
5.5% of test tokens), 102 characters. Other Python versions ship other revisions of the text:
``info["text_sha256"]`` and ``info["python"]`` (in every run's summary.json, ``data``) tell
them apart.
"""
from __future__ import annotations

import hashlib
import platform
import re
from typing import Iterable, Optional

import numpy as np

from .base import DataBundle
from .text import EOS, UNK, lm_bundle

SPLITS = ("train", "valid", "test")
LEVELS = ("word", "char")
# the table above, as data: tests/test_pydoc.py checks the loader against it on this text
REFERENCE = {"python": "3.11.7", "text_sha256": "6c7d68cee92383c2d38e91c095bc7f45b93d936d39b8d4c5fe1b718baf09dc63",
             "topics": {"train": 64, "valid": 5, "test": 10},
             "word": {"tokens": {"train": 88079, "valid": 7140, "test": 10814}, "vocab_size": 2307},
             "char": {"tokens": {"train": 373136, "valid": 28688, "test": 43932}, "vocab_size": 102}}
_DECORATION = re.compile(r"^[\s*=\-~^+|_]*$")
_WORD = re.compile(r"[a-z_][a-z0-9_]*|\d+(?:\.\d+)?|[^\sa-z0-9_]")


def topics() -> dict:
    """{topic name: text} of this Python's ``pydoc_data.topics``."""
    from pydoc_data.topics import topics as table
    return dict(table)


def split_of(name: str) -> str:
    """The split a topic belongs to: sha256 of its name, 0 mod 10 test, 1 mod 10 valid."""
    bucket = int(hashlib.sha256(name.encode("utf-8")).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "valid" if bucket == 1 else "train"


def text_digest(table: dict) -> str:
    """sha256 of every topic's name and text, in name order: it tells texts of other Pythons apart."""
    h = hashlib.sha256()
    for name in sorted(table):
        h.update(name.encode("utf-8") + b"\0" + table[name].encode("utf-8") + b"\0")
    return h.hexdigest()


def sentences(text: str) -> Iterable[str]:
    """The lines that carry text: blank lines and decoration dropped."""
    return (line for line in text.splitlines() if not _DECORATION.match(line))


def tokens(text: str, level: str = "word") -> list:
    """One topic's tokens, ``<eos>`` after each line (see the module doc)."""
    out: list = []
    for line in sentences(text):
        if level == "char":
            out.extend(line)
        else:
            out.extend("N" if w[0].isdigit() else w for w in _WORD.findall(line.lower()))
        out.append(EOS)
    return out


def split_tokens(level: str = "word", table: Optional[dict] = None) -> dict:
    """{split: the tokens of its topics, in topic-name order}."""
    table = topics() if table is None else table
    out: dict = {s: [] for s in SPLITS}
    for name in sorted(table):
        out[split_of(name)].extend(tokens(table[name], level))
    return out


def vocabulary(train: list, min_count: int) -> list:
    """Train tokens seen at least ``min_count`` times, in first-appearance order, then ``<unk>``."""
    counts: dict = {}
    for tok in train:
        counts[tok] = counts.get(tok, 0) + 1
    itos = [tok for tok in counts if counts[tok] >= min_count and tok != UNK]
    return itos + [UNK]


def build_pydoc(path: Optional[str], rank: int, size: int, seed: int, *, level: str = "word",
                seq_len: int = 35, min_count: int = 2, eval_split: str = "test") -> DataBundle:
    """The pydoc bundle; ``path`` is ignored (the text ships with Python)."""
    if level not in LEVELS:
        raise ValueError(f"pydoc option 'level' must be 'word' or 'char', got {level!r}")
    if eval_split not in ("valid", "test"):
        raise ValueError(f"pydoc option 'eval_split' must be 'valid' or 'test', got {eval_split!r}")
    if int(min_count) < 1:
        raise ValueError(f"pydoc option 'min_count' must be >= 1, got {min_count}")
    table = topics()
    streams = split_tokens(level, table)
    itos = vocabulary(streams["train"], int(min_count))
    stoi = {tok: i for i, tok in enumerate(itos)}
    unk = stoi[UNK]
    ids = {s: np.fromiter((stoi.get(tok, unk) for tok in streams[s]), dtype=np.int64, count=len(streams[s]))
           for s in SPLITS}
    info = {"python": platform.python_version(), "text_sha256": text_digest(table), "level": level,
            "eval_split": eval_split, "min_count": int(min_count), "vocab_size": len(itos),
            "topics": {s: sum(split_of(n) == s for n in table) for s in SPLITS},
            "tokens": {s: len(streams[s]) for s in SPLITS},
            "unk_fraction": {s: float(np.mean(ids[s] == unk)) for s in SPLITS}, "vocab": itos}
    return lm_bundle(ids["train"], ids[eval_split], len(itos), int(seq_len), rank, size, seed, "pydoc", info)
