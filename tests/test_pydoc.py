"""The pydoc text corpus (redsync_hvd/data/pydoc.py): a fixed split by topic, PTB's conventions,
deterministic, and sizes as documented for the text of this Python."""
import hashlib

import pytest
import torch

from redsync_hvd.data import build_datasets, dataset_options, pydoc
from redsync_hvd.data.text import EOS, UNK


def test_every_topic_is_in_exactly_one_split_by_the_hash_of_its_name():
    table = pydoc.topics()
    by_split = {s: {n for n in table if pydoc.split_of(n) == s} for s in pydoc.SPLITS}
    assert set().union(*by_split.values()) == set(table)
    assert sum(len(v) for v in by_split.values()) == len(table)          # disjoint
    for name in table:   # the documented rule, computed here independently of split_of
        bucket = int.from_bytes(hashlib.sha256(name.encode()).digest(), "big") % 10
        assert name in by_split[{0: "test", 1: "valid"}.get(bucket, "train")]
    assert all(by_split[s] for s in pydoc.SPLITS)


def test_split_streams_hold_their_own_topics_only():
    """Each split's token stream is the concatenation of its topics' tokens, and a topic's text
    is in no other split's stream."""
    table = pydoc.topics()
    streams = pydoc.split_tokens("word", table)
    for split in pydoc.SPLITS:
        expect = [t for n in sorted(table) if pydoc.split_of(n) == split for t in pydoc.tokens(table[n])]
        assert streams[split] == expect
    name = next(n for n in sorted(table) if pydoc.split_of(n) == "test")
    one = pydoc.tokens(table[name])
    train = " ".join(streams["train"])
    assert " ".join(one[:60]) in " ".join(streams["test"]) and " ".join(one[:60]) not in train


def test_sizes_are_the_documented_ones_for_this_text():
    ref = pydoc.REFERENCE
    table = pydoc.topics()
    digest = pydoc.text_digest(table)
    if digest != ref["text_sha256"]:
        pytest.skip(f"this Python ships another revision of the text ({digest[:12]}); sizes are documented for "
                    f"CPython {ref['python']}")
    assert {s: sum(pydoc.split_of(n) == s for n in table) for s in pydoc.SPLITS} == ref["topics"]
    for level in pydoc.LEVELS:
        b = build_datasets("pydoc", level=level, eval_split="valid")
        assert b.info["tokens"] == ref[level]["tokens"] and b.num_classes == ref[level]["vocab_size"]
    doc = pydoc.__doc__
    for level in pydoc.LEVELS:   # the module's table shows the same numbers
        assert all(f"{n:,}" in doc for n in ref[level]["tokens"].values()), level
    assert f"{ref['word']['vocab_size']:,} words" in doc and f"{ref['char']['vocab_size']} characters" in doc


def test_ptb_conventions_words():
    text = "The \"assert\" statement\n**********************\n\nx = 42 + y.z\n   +-----+\n| a | 3.5 |\n"
    assert pydoc.tokens(text) == ["the", '"', "assert", '"', "statement", EOS,
                                  "x", "=", "N", "+", "y", ".", "z", EOS, "|", "a", "|", "N", "|", EOS]
    assert pydoc.tokens("Ab c\n", "char") == ["A", "b", " ", "c", EOS]
    itos = pydoc.vocabulary(["a", "b", "a", "c", "b", "a"], min_count=2)
    assert itos == ["a", "b", UNK]


def test_bundle_windows_vocabulary_and_unk():
    b = build_datasets("pydoc", rank=0, size=2, seq_len=20)
    itos = b.info["vocab"]
    assert b.task == "lm" and b.input_shape == (20,) and b.num_classes == len(itos) and itos[-1] == UNK
    assert EOS in itos and "the" in itos and "N" in itos
    x, y = b.test[0]
    assert x.shape == (20,) and torch.equal(x[1:], y[:-1])
    assert len(b.test) == (b.info["tokens"]["test"] - 1) // 20
    unk = itos.index(UNK)
    assert 0 < b.info["unk_fraction"]["train"] < b.info["unk_fraction"]["test"] < 0.2
    assert (b.test.tensors[0] == unk).any()
    assert set(dataset_options("pydoc")) == {"level", "seq_len", "min_count", "eval_split"}


def test_deterministic_and_sharded():
    a0, a1 = (build_datasets("pydoc", rank=r, size=2, seed=3) for r in (0, 1))
    again = build_datasets("pydoc", rank=0, size=2, seed=3)
    assert torch.equal(a0.train.tensors[0], again.train.tensors[0]) and torch.equal(a0.test.tensors[0],
                                                                                     again.test.tensors[0])
    assert a0.info["vocab"] == again.info["vocab"] and a0.info["text_sha256"] == again.info["text_sha256"]
    assert len(a0.train) == len(a1.train) == a0.info["train_size_total"] // 2
    rows = {tuple(r) for r in a0.train.tensors[0].tolist()}
    assert not rows & {tuple(r) for r in a1.train.tensors[0].tolist()}      # disjoint shards
    other_seed = build_datasets("pydoc", rank=0, size=2, seed=4)
    assert torch.equal(a0.test.tensors[0], other_seed.test.tensors[0])      # the split ignores the seed
    assert not torch.equal(a0.train.tensors[0], other_seed.train.tensors[0])


def test_record_names_the_python_and_the_text():
    b = build_datasets("pydoc", level="char", seq_len=50, eval_split="valid")
    rec = b.record()
    assert rec["name"] == "pydoc" and rec["level"] == "char" and rec["eval_split"] == "valid"
    assert rec["python"].count(".") == 2 and len(rec["text_sha256"]) == 64 and "vocab" not in rec
    assert rec["test_size"] == len(b.test) == (b.info["tokens"]["valid"] - 1) // 50


def test_bad_options():
    with pytest.raises(ValueError, match="level"):
        build_datasets("pydoc", level="byte")
    with pytest.raises(ValueError, match="eval_split"):
        build_datasets("pydoc", eval_split="train")
    with pytest.raises(ValueError, match="min_count"):
        build_datasets("pydoc", min_count=0)
    with pytest.raises(TypeError, match="valid options"):
        build_datasets("pydoc", vocab_size=10)
