"""The data sets from Debian's packages: Fashion-MNIST (data/fashion.py, MNIST's idx reader) and
Jane Austen's novels (data/austen.py over R's lazy-load database, data/rdb.py).

Each loader on small files written here (idx .gz files; an R database serialized here by hand,
independent of the reader), then on the real files where the machine has them (skipped with the
command that installs them otherwise), then real ``horovodrun -np 2`` runs of the YAML runner on
each, and the one-line error of a run whose files are missing.
"""
import gzip
import lzma
import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from launch import REPO, horovodrun, summary, train_args

from redsync_hvd.data import austen, build_datasets, dataset_options, fashion, rdb
from redsync_hvd.data.text import EOS, UNK

TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")


def _real_austen():
    try:
        return austen.locate()
    except FileNotFoundError:
        pytest.skip("no r-cran-janeaustenr copy: run bash scripts/install.sh as root (scripts/install_data.sh)")


def _real_fashion():
    if not os.path.isfile(os.path.join(fashion.DEFAULT_PATH, "train-images-idx3-ubyte.gz")):
        pytest.skip("no Fashion-MNIST: apt-get install dataset-fashion-mnist (as root)")
    return fashion.DEFAULT_PATH


# ------------------------------------------------------------------------- small files, written here

def _idx(path: Path, array: np.ndarray, magic: int) -> None:
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _fashion_files(folder: Path, n_train: int = 12, n_test: int = 4) -> tuple:
    rng = np.random.default_rng(0)
    x_tr, x_te = rng.integers(0, 256, (n_train, 28, 28)), rng.integers(0, 256, (n_test, 28, 28))
    y_tr, y_te = np.arange(n_train) % 10, np.arange(n_test) % 10
    for name, a, magic in (("train-images-idx3-ubyte", x_tr, 2051), ("train-labels-idx1-ubyte", y_tr, 2049),
                           ("t10k-images-idx3-ubyte", x_te, 2051), ("t10k-labels-idx1-ubyte", y_te, 2049)):
        _idx(folder / f"{name}.gz", a, magic)
    return x_tr, y_tr, x_te, y_te


def test_fashion_mnist_on_small_idx_files(tmp_path):
    x_tr, y_tr, x_te, y_te = _fashion_files(tmp_path)
    b = build_datasets("fashion_mnist", path=str(tmp_path), rank=1, size=2, seed=0)
    assert b.name == "fashion_mnist" and b.task == "classification" and b.num_classes == 10
    assert b.input_shape == (1, 28, 28) and len(b.train) == 6 and len(b.test) == 4
    x, y = b.test[2]
    expect = (torch.from_numpy(x_te[2]).float() / 255 - fashion.FASHION_MEAN[0]) / fashion.FASHION_STD[0]
    assert torch.allclose(x[0], expect) and int(y) == y_te[2]
    assert b.record()["classes"][9] == "Ankle boot" and set(dataset_options("fashion_mnist")) == {"normalize"}
    raw = build_datasets("fashion_mnist", path=str(tmp_path), normalize=False)
    assert torch.allclose(raw.test[0][0][0], torch.from_numpy(x_te[0]).float() / 255)


def test_fashion_mnist_missing_files_is_one_line_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        build_datasets("fashion_mnist", path=str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "apt-get install dataset-fashion-mnist" in msg and "data.path=" in msg, msg


def _r_object(obj) -> bytes:
    """R's XDR serialization (src/main/serialize.c) of a str list (NA as None), an int or bool
    array, or a dict (a named list); what the test database holds."""
    i32 = struct.Struct(">i").pack
    if isinstance(obj, dict):
        out = i32(19 | 1 << 9) + i32(len(obj)) + b"".join(_r_object(v) for v in obj.values())
        names = _r_object(list(obj))   # attributes: a pairlist, one node tagged "names"
        return out + i32(2 | 1 << 10) + i32(1) + _r_char("names") + names + i32(254)
    if isinstance(obj, list):
        return i32(16) + i32(len(obj)) + b"".join(_r_char(s) for s in obj)
    kind = 10 if obj.dtype == bool else 13
    return i32(kind) + i32(len(obj)) + b"".join(i32(int(v)) for v in obj)


def _r_char(s) -> bytes:
    if s is None:
        return struct.pack(">ii", 9, -1)
    data = s.encode("utf-8")
    return struct.pack(">ii", 9 | 8 << 12, len(data)) + data   # gp 8: UTF-8


def _write_lazyload(folder: Path, objects: dict, xz: bool = False) -> None:
    """An R package's data/Rdata.rdx + Rdata.rdb (see data/rdb.py), one zlib entry per object (``xz``:
    R's compress = 3 with an xz codec byte, as ``tools:::makeLazyLoadDB(compress = 3)`` writes)."""
    header = b"X\n" + struct.pack(">iii", 2, 0x040201, 0x020300)
    folder.mkdir(parents=True, exist_ok=True)
    entries, offset = {}, 0
    with open(folder / "Rdata.rdb", "wb") as f:
        for name, value in objects.items():
            body = header + _r_object(value)
            packed = b"X" + lzma.compress(body) if xz else zlib.compress(body)
            entry = struct.pack(">I", len(body)) + packed
            f.write(entry)
            entries[name] = np.array([offset, len(entry)])
            offset += len(entry)
    index = {"variables": entries, "references": {}, "compressed": np.array([3]) if xz else np.array([True])}
    with gzip.open(folder / "Rdata.rdx", "wb") as f:
        f.write(header + _r_object(index))


def _novel(title: str, chapters: int) -> list:
    lines = [title.upper(), "", "by Jane Austen", ""]
    for k in range(1, chapters + 1):
        lines += [f"CHAPTER {k}", "", f"It was chapter {k} of {title}, in 1811.", "Mr. Darcy's £5 said: \"No!\"",
                  "", f"only{'abcdefghijklmnopq'[k - 1]} here.", ""]
    return lines


def _small_austen(folder: Path) -> dict:
    novels = {name: _novel(name, 12 + i) for i, name in enumerate(austen.NOVELS)}
    _write_lazyload(folder / "data", {**novels, "extra": ["kept out", None]})
    return novels


def test_lazyload_reader_on_a_database_written_here(tmp_path):
    _write_lazyload(tmp_path, {"a": ["x", None, "£ é"], "b": ["only"]})
    assert rdb.index(str(tmp_path))["compressed"] == 1
    assert rdb.read_lazyload(str(tmp_path)) == {"a": ["x", None, "£ é"], "b": ["only"]}
    assert rdb.read_lazyload(str(tmp_path), ["b"]) == {"b": ["only"]}
    with pytest.raises(ValueError, match="holds no object"):
        rdb.read_lazyload(str(tmp_path), ["c"])
    _write_lazyload(tmp_path / "xz", {"a": ["x", "y"]}, xz=True)
    assert rdb.index(str(tmp_path / "xz"))["compressed"] == 3
    assert rdb.read_lazyload(str(tmp_path / "xz")) == {"a": ["x", "y"]}


def test_austen_on_a_small_database(tmp_path):
    novels = _small_austen(tmp_path / "janeaustenr")
    b = build_datasets("austen", path=str(tmp_path / "janeaustenr"), seq_len=5, min_count=1, eval_split="valid")
    info, itos = b.info, b.info["vocab"]
    assert b.task == "lm" and b.input_shape == (5,) and itos[-1] == UNK and b.num_classes == len(itos)
    assert info["lines"] == {n: len(novels[n]) for n in austen.NOVELS}
    total = sum(12 + i for i in range(6))           # chapters; 10 and 11 (and 1) leave train
    assert info["chapters"] == {"train": total - 6 * 3, "valid": 12, "test": 6}
    one = austen.tokens(novels["emma"][:11])        # the title page and chapter 1
    assert one == ["emma", EOS, "by", "jane", "austen", EOS, "chapter", "N", EOS, "it", "was", "chapter", "N",
                   "of", "emma", "in", "N", "mr", "darcy's", "N", "said", "no", EOS, "onlya", "here", EOS]
    assert info["tokens"]["valid"] == 6 * 2 * 20    # chapters 1 and 11 of each novel, 20 tokens each
    assert "onlyj" not in itos and info["unk_fraction"]["train"] == 0 and info["unk_fraction"]["test"] == 1 / 20
    assert (b.test.tensors[0][0] == torch.tensor([itos.index(t) for t in ["chapter", "N", EOS, "it", "was"]])).all()


def test_austen_missing_is_one_line_with_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv(austen.CACHE_ENV, str(tmp_path / "cache"))
    for path, where in ((None, tmp_path / "cache" / "janeaustenr"), (str(tmp_path), tmp_path / "data")):
        with pytest.raises(FileNotFoundError) as e:
            austen.locate(path)
        msg = str(e.value)
        assert "\n" not in msg and "apt-get download r-cran-janeaustenr" in msg and "data.path=" in msg, msg
        assert str(where) in msg, msg
    with pytest.raises(ValueError, match="min_count"):
        build_datasets("austen", path=str(tmp_path), min_count=0)


# ------------------------------------------------------------------------- the real files

def test_real_fashion_mnist_sizes_labels_and_its_mean_and_std():
    path = _real_fashion()
    b = build_datasets("fashion_mnist", normalize=False)     # data.path unset: Debian's copy
    assert b.info["path"] == path and b.info["train_size_total"] == 60000 and len(b.test) == 10000
    x, y = b.train.tensors
    assert x.shape == (60000, 1, 28, 28) and x.dtype == torch.uint8
    assert set(y.unique().tolist()) == set(range(10)) == set(b.test.tensors[1].unique().tolist())
    pixels = x.double() / 255                                   # the constants, computed again
    assert round(pixels.mean().item(), 4) == fashion.FASHION_MEAN[0]
    assert round(pixels.std(unbiased=False).item(), 4) == fashion.FASHION_STD[0]


def test_real_austen_against_the_documented_tables():
    folder = _real_austen()
    ref = austen.REFERENCE
    table = austen.novels(folder)
    assert {n: len(table[n]) for n in austen.NOVELS} == ref["lines"]
    assert {n: len(austen.chapters(table[n])) - 1 for n in austen.NOVELS} == ref["chapters"]
    b = build_datasets("austen", seq_len=35)
    info = b.info
    assert info["tokens"] == ref["tokens"] and info["vocab_size"] == ref["vocab_size"] == b.num_classes
    assert info["chapters"] == ref["split_chapters"] and info["min_count"] == ref["min_count"]
    streams, _ = austen.split_tokens(table)
    assert sum(t != EOS for split in streams.values() for t in split) == ref["words"]
    assert {s: round(100 * f, 2) for s, f in info["unk_fraction"].items()} == ref["unk_percent"]
    assert len(b.test) == (ref["tokens"]["test"] - 1) // 35
    doc = austen.__doc__.replace(",", "")
    for s in austen.SPLITS:     # the module's table shows the same numbers
        assert re.search(rf"{s}\s+{ref['split_chapters'][s]}\s+{ref['tokens'][s]}\s+{ref['unk_percent'][s]:.2f}%",
                         doc), s
    for n in austen.NOVELS:
        assert re.search(rf"{n}\s+{ref['lines'][n]}\s+{ref['chapters'][n]}", doc), n
    assert f"vocabulary of {ref['vocab_size']}" in doc


# ------------------------------------------------------------------------- the runner, 2 workers

CONFIGS = {
    "fashion": """model: {name: cnn}
data: {name: fashion_mnist}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9}
training: {steps: 4, batch_size: 32, log_every: 2, checkpoint_every_s: 0}
compression: {method: redsync, density: 0.01}
""",
    "austen": """model: {name: lstm_lm, options: {embed_dim: 32, hidden: 32, num_layers: 1}}
data: {name: austen, options: {seq_len: 35}}
optimizer: {name: sgd, lr: 1.0}
training: {steps: 4, batch_size: 20, log_every: 2, checkpoint_every_s: 0}
compression: {method: redsync, density: 0.01}
"""}


def _config(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(CONFIGS[name])
    return str(path)


def _errors(text: str) -> list:
    return [l for l in TAG.sub("\n", text).splitlines() if l.startswith("error: ")]


@pytest.mark.parametrize("name", ["fashion", "austen"])
def test_two_workers_train_a_few_steps_on_the_real_data(tmp_path, name):
    (_real_fashion if name == "fashion" else _real_austen)()
    horovodrun(train_args(tmp_path, _config(tmp_path, name)), np=2, timeout=240)
    s = summary(tmp_path / name)
    assert s["steps"] == 4 and s["workers"] == 2 and np.isfinite(s["final_loss"]), s
    data = s["data"]
    if name == "fashion":
        assert data["name"] == "fashion_mnist" and data["train_size"] == 30000 and data["test_size"] == 10000
    else:
        ref = austen.REFERENCE
        assert data["name"] == "austen" and data["num_classes"] == ref["vocab_size"]
        assert data["tokens"] == ref["tokens"] and data["test_size"] == (ref["tokens"]["test"] - 1) // 35


@pytest.mark.parametrize("name", ["fashion", "austen"])
def test_missing_files_stop_both_workers_in_one_line(tmp_path, name):
    empty = tmp_path / "empty"
    empty.mkdir()
    if name == "fashion":   # data.path to an empty folder
        args, env, fix = train_args(tmp_path, _config(tmp_path, name), f"data.path={empty}"), None, \
            "apt-get install dataset-fashion-mnist"
    else:                   # the cache variable to an empty folder, data.path unset
        if os.path.isdir(austen.SYSTEM_PACKAGE):
            pytest.skip(f"R's janeaustenr is installed in {austen.SYSTEM_PACKAGE}: the loader reads that one")
        args, env, fix = train_args(tmp_path, _config(tmp_path, name)), {austen.CACHE_ENV: str(empty)}, \
            "apt-get download r-cran-janeaustenr"
    res = horovodrun(args, np=2, timeout=180, env=env, check=False)
    errors = _errors(res.stdout)
    assert res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stdout, res.stdout[-3000:]
    assert errors[0].startswith("error: data: ") and fix in errors[0] and str(empty) in errors[0], errors


def test_install_data_script_sees_what_is_there_and_names_the_command_elsewhere(tmp_path):
    """scripts/install_data.sh (run by scripts/install.sh): a copy in the cache is left as it is; a
    user who is not root gets the command, and the install goes on."""
    folder, _ = _real_austen(), _real_fashion()   # (as root, a missing one would be installed here)
    cache = tmp_path / "cache"
    shutil.copytree(folder, cache / "janeaustenr" / "data")
    script = str(REPO / "scripts" / "install_data.sh")
    res = subprocess.run(["bash", script], env={**os.environ, austen.CACHE_ENV: str(cache)}, capture_output=True,
                         text=True, timeout=60)
    lines = [l for l in res.stdout.splitlines() if "[install]" in l]
    assert res.returncode == 0 and len(lines) == 2 and "already" in lines[1] and str(cache) in lines[1], res.stdout
    if os.getuid() != 0 or not shutil.which("setpriv"):
        return
    # the script on stdin: a checkout under a private folder (mktemp -d is 0700) is not nobody's to read
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "bash", "-s"]
    with open(script) as text:
        res = subprocess.run(nobody, stdin=text, capture_output=True, text=True, timeout=60,
                             env={**os.environ, "HOME": str(tmp_path), austen.CACHE_ENV: str(tmp_path / "none")})
    assert res.returncode == 0 and "apt-get download r-cran-janeaustenr" in res.stdout, res.stdout + res.stderr
