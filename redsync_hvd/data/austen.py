"""Jane Austen's six novels, word level (task lm), from Debian's ``r-cran-janeaustenr``.

The R package janeaustenr (Silge, 2017) holds the Project Gutenberg text of each novel as one
character vector, one element per printed line, in its lazy-load database (``data/Rdata.rdx``,
``data/Rdata.rdb``, read by ``data/rdb.py``). ``scripts/install.sh`` as root runs ``apt-get
download r-cran-janeaustenr`` and unpacks it (``dpkg -x``, R is not installed) into
``$REDSYNC_DATA_CACHE/janeaustenr/`` (default ``~/.cache/redsync_hvd/data``). ``data.path``
may name another folder with the two files (or the package folder above ``data/``); without
either, the R package installed by apt (``/usr/lib/R/site-library/janeaustenr``) is read.

**Words**, PTB's conventions (``data/text.py``, ``data/pydoc.py``): the text is lower-cased; a
token is a word (letters, with inner apostrophes kept: ``don't``, ``emma's``) or a number
(written ``N``); punctuation is dropped, as in Mikolov's PTB. A paragraph (lines up to an empty
line) ends in ``<eos>``: the lines themselves are Gutenberg's typesetting, not sentences. Empty
lines, and paragraphs without a word, are dropped. The vocabulary is the train split's words
seen at least ``min_count`` times, then ``<unk>`` (``pydoc.vocabulary``). Windows as the other
LMs: ``text.lm_bundle`` (non-overlapping, ``seq_len``).

**Split (fixed, by chapter).** A novel's k-th chapter heading (``CHAPTER I``, ``Chapter 12``,
...; Emma's volumes count on, so k runs 1..55) starts chapter k. Chapter k with k mod 10 == 0 is
in ``test``, 1 mod 10 in ``valid``, every other chapter, and the title pages before chapter 1,
in ``train``. ``eval_split`` chooses what the runner evaluates on (``test`` by default).

The novels as r-cran-janeaustenr 1.0.0 ships them (``REFERENCE``; lines: elements of the
character vector, empty ones included):

================= ====== ========
novel             lines  chapters
================= ====== ========
sensesensibility  12,624 50
prideprejudice    13,030 61
mansfieldpark     15,349 48
emma              16,235 55
northangerabbey    7,856 31
persuasion         8,328 24
================= ====== ========

Tokens (``<eos>`` included; 725,086 words and 10,291 ``<eos>``) and ``<unk>`` rates with the
defaults (``min_count: 2``: a vocabulary of 8,745 with ``<unk>``):

===== ======== ======= ======
split chapters tokens  <unk>
===== ======== ======= ======
train 214      591,420 0.71%
valid 30        78,415 1.52%
test  25        65,542 1.54%
===== ======== ======= ======
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Iterable, Optional

import numpy as np

from .base import CACHE_ENV as CACHE_ENV  # noqa: F401  (the tests and the install script's docs name it here)
from .base import DataBundle, cache_dir
from .pydoc import vocabulary
from .rdb import RDB, RDX, read_lazyload
from .text import EOS, UNK, lm_bundle

SPLITS = ("train", "valid", "test")
NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
SYSTEM_PACKAGE = "/usr/lib/R/site-library/janeaustenr"
# the tables above, as data: tests/test_real_data.py checks the loader against them on the real files
REFERENCE = {"package": "r-cran-janeaustenr 1.0.0",
             "lines": {"sensesensibility": 12624, "prideprejudice": 13030, "mansfieldpark": 15349,
                       "emma": 16235, "northangerabbey": 7856, "persuasion": 8328},
             "chapters": {"sensesensibility": 50, "prideprejudice": 61, "mansfieldpark": 48, "emma": 55,
                          "northangerabbey": 31, "persuasion": 24},
             "split_chapters": {"train": 214, "valid": 30, "test": 25},
             "tokens": {"train": 591420, "valid": 78415, "test": 65542}, "words": 725086,
             "min_count": 2, "vocab_size": 8745, "unk_percent": {"train": 0.71, "valid": 1.52, "test": 1.54}}
_HEADING = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\b", re.IGNORECASE)
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*|\d+(?:[.,]\d+)*")


def _fix(cache: str) -> str:
    return (f"as root, bash scripts/install.sh (it runs apt-get download r-cran-janeaustenr and unpacks it into "
            f"{cache}/janeaustenr); elsewhere: apt-get download r-cran-janeaustenr && dpkg -x "
            f"r-cran-janeaustenr_*.deb x && mkdir -p {cache} && cp -r x/usr/lib/R/site-library/janeaustenr "
            f"{cache}/; or pass data.path=/folder/with/{RDB}")


def locate(path: Optional[str] = None) -> str:
    """The folder holding ``Rdata.rdx`` and ``Rdata.rdb``; FileNotFoundError (one line, with the
    fix) if none of the places holds them."""
    cache = cache_dir()
    roots = [path] if path else [os.path.join(cache, "janeaustenr"), SYSTEM_PACKAGE]
    places = [p for root in roots for p in (root, os.path.join(root, "data"))]
    for place in places:
        if all(os.path.isfile(os.path.join(place, f)) for f in (RDX, RDB)):
            return place
    raise FileNotFoundError(
        f"dataset 'austen' needs Jane Austen's novels from Debian's r-cran-janeaustenr ({RDX}, {RDB}), found in "
        f"none of {', '.join(places)}. Fix: {_fix(cache)}")


def novels(folder: str) -> dict:
    """{novel: its lines} of the six novels in the database in ``folder``."""
    table = read_lazyload(folder, NOVELS)
    return {name: ["" if line is None else str(line) for line in table[name]] for name in NOVELS}


def chapters(lines: list) -> list:
    """The novel's lines cut at its chapter headings: [(k, lines of chapter k)], k = 0 the title pages."""
    out: list = [(0, [])]
    for line in lines:
        if _HEADING.match(line):
            out.append((len(out), []))
        out[-1][1].append(line)
    return out


def split_of(k: int) -> str:
    """Chapter k's split: 0 mod 10 test, 1 mod 10 valid, else (and the title pages, k = 0) train."""
    return "train" if k == 0 else "test" if k % 10 == 0 else "valid" if k % 10 == 1 else "train"


def tokens(lines: Iterable[str]) -> list:
    """The words of ``lines``, ``<eos>`` after each paragraph (see the module doc)."""
    out: list = []
    words: list = []
    for line in list(lines) + [""]:
        if line.strip():
            words.extend("N" if w[0].isdigit() else w for w in _WORD.findall(line.lower()))
        elif words:
            out.extend(words)
            out.append(EOS)
            words = []
    return out


def split_tokens(table: dict) -> tuple:
    """({split: the tokens of its chapters, novel by novel in ``NOVELS`` order}, {split: chapters})."""
    streams: dict = {s: [] for s in SPLITS}
    counts = {s: 0 for s in SPLITS}
    for name in NOVELS:
        for k, lines in chapters(table[name]):
            streams[split_of(k)].extend(tokens(lines))
            counts[split_of(k)] += k > 0
    return streams, counts


def text_digest(table: dict) -> str:
    """sha256 of the six novels' lines: it tells other revisions of the package apart."""
    h = hashlib.sha256()
    for name in NOVELS:
        h.update(name.encode("utf-8") + b"\0" + "\n".join(table[name]).encode("utf-8") + b"\0")
    return h.hexdigest()


def build_austen(path: Optional[str], rank: int, size: int, seed: int, *, seq_len: int = 35,
                 min_count: int = 2, eval_split: str = "test") -> DataBundle:
    """The austen bundle (see the module doc); ``path``: a folder with Rdata.rdx and Rdata.rdb."""
    if eval_split not in ("valid", "test"):
        raise ValueError(f"austen option 'eval_split' must be 'valid' or 'test', got {eval_split!r}")
    if int(min_count) < 1:
        raise ValueError(f"austen option 'min_count' must be >= 1, got {min_count}")
    folder = locate(path)
    table = novels(folder)
    streams, counts = split_tokens(table)
    itos = vocabulary(streams["train"], int(min_count))
    stoi = {tok: i for i, tok in enumerate(itos)}
    unk = stoi[UNK]
    ids = {s: np.fromiter((stoi.get(t, unk) for t in streams[s]), dtype=np.int64, count=len(streams[s]))
           for s in SPLITS}
    info = {"source": folder, "text_sha256": text_digest(table), "eval_split": eval_split,
            "min_count": int(min_count), "vocab_size": len(itos), "chapters": counts,
            "lines": {n: len(table[n]) for n in NOVELS}, "tokens": {s: len(streams[s]) for s in SPLITS},
            "unk_fraction": {s: float(np.mean(ids[s] == unk)) if len(ids[s]) else 0.0 for s in SPLITS},
            "vocab": itos}
    return lm_bundle(ids["train"], ids[eval_split], len(itos), int(seq_len), rank, size, seed, "austen", info)
