"""Fast single-process tests for redsync_hvd.models and redsync_hvd.data."""
from __future__ import annotations

import gzip
import os
import pickle
import struct
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from redsync_hvd.data import DATASET_NAMES, DataBundle, build_datasets, shard_indices
from redsync_hvd.models import MODEL_NAMES, build_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The CI box has 2 shared cores: intra-op threading there is >10x *slower* for these
    tiny ops (thread oversubscription), so run this module single-threaded."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

# ----------------------------------------------------------------------------- models

CLASSIFIER_CASES = [
    ("mlp", (1, 8, 8), {}),
    ("mlp", (20,), {"hidden": [16]}),
    ("cnn", (1, 8, 8), {}),
    ("cnn", (1, 28, 28), {"width": 0.5}),
    ("cnn", (3, 32, 32), {}),
    ("resnet20", (3, 32, 32), {}),
    ("vgg", (3, 32, 32), {}),
    ("vgg", (3, 32, 32), {"fc_width": 64, "batch_norm": False, "width": 0.25, "depth": 16}),
    ("vgg", (1, 8, 8), {"width": 0.25}),
]


@pytest.mark.parametrize("name,shape,opts", CLASSIFIER_CASES)
def test_classifier_forward_backward(name, shape, opts):
    torch.manual_seed(0)
    model = build_model(name, 7, shape, **opts)
    x = torch.randn((3,) + shape)
    out = model(x)
    assert out.shape == (3, 7)
    F.cross_entropy(out, torch.tensor([0, 1, 6])).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_resnet20_structure():
    model = build_model("resnet20", 10, (3, 32, 32))
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.26e6 < n_params < 0.28e6  # He et al. report 0.27M
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 19 and {c.out_channels for c in convs} == {16, 32, 64}


def test_vgg_large_fc_is_communication_heavy():
    model = build_model("vgg", 10, (3, 32, 32), fc_width=4096, width=0.125)
    fc = sum(p.numel() for m in model.classifier for p in m.parameters())
    assert fc > 16e6 and fc > 0.9 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("opts", [{}, {"embed_dim": 32, "hidden": 32, "tie_weights": True,
                                       "num_layers": 1, "vocab_size": 50}])
def test_lstm_lm_forward_backward(opts):
    torch.manual_seed(0)
    model = build_model("lstm_lm", 50, (12,), **opts)
    x = torch.randint(0, 50, (4, 12))
    logits = model(x)
    assert logits.shape == (4, 12, 50)
    F.cross_entropy(logits.reshape(-1, 50), x.reshape(-1)).backward()
    assert model.embedding.weight.grad is not None
    if opts.get("tie_weights"):
        assert model.decoder.weight is model.embedding.weight
    logits2, (h, c) = model(x, return_state=True)
    assert h.shape[0] == model.lstm.num_layers


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_models_deterministic_init(name):
    shape = (10,) if name in ("lstm_lm", "gpt") else (3, 16, 16)
    opts = {"width": 0.25, "fc_width": 32} if name == "vgg" else {}
    states = []
    for _ in range(2):
        torch.manual_seed(123)
        states.append(build_model(name, 10, shape, **opts).state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_model_errors():
    with pytest.raises(ValueError, match="resnet20"):
        build_model("resnet50", 10, (3, 32, 32))
    with pytest.raises(TypeError, match="hiden"):
        build_model("mlp", 10, (1, 8, 8), hiden=[3])
    with pytest.raises(ValueError, match="tie_weights"):
        build_model("lstm_lm", 10, (5,), embed_dim=8, hidden=16, tie_weights=True)
    with pytest.raises(ValueError, match="vocab_size"):
        build_model("lstm_lm", 10, (5,), vocab_size=11)

# ----------------------------------------------------------------------------- sharding


def test_shard_indices_partition():
    n, size = 103, 4
    shards = [shard_indices(n, r, size, seed=5) for r in range(size)]
    assert {len(s) for s in shards} == {n // size}
    union = np.concatenate(shards)
    assert len(set(union.tolist())) == len(union) == size * (n // size)
    perm = np.random.default_rng(5).permutation(n)
    assert set(union.tolist()) == set(perm[: size * (n // size)].tolist())
    assert np.array_equal(shards[1], shard_indices(n, 1, size, seed=5))
    assert not np.array_equal(shards[1], shard_indices(n, 1, size, seed=6))
    with pytest.raises(ValueError):
        shard_indices(n, 4, 4, 0)


def _rows(ds):
    return Counter(bytes(x.numpy().tobytes()) + bytes(int(y).to_bytes(1, "little"))
                   for x, y in zip(*ds.tensors))


def test_digits_bundle_and_shards():
    full = build_datasets("digits", seed=3)
    assert isinstance(full, DataBundle) and full.task == "classification"
    assert full.num_classes == 10 and full.input_shape == (1, 8, 8)
    x, y = full.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    xs, ys = full.train.tensors
    assert 0.0 <= xs.min() and xs.max() <= 1.0 and set(ys.tolist()) == set(range(10))
    assert len(full.train) + len(full.test) == 1797 and len(full.test) == 360
    size = 3
    bundles = [build_datasets("digits", rank=r, size=size, seed=3) for r in range(size)]
    assert {len(b.train) for b in bundles} == {len(full.train) // size}
    assert all(torch.equal(b.test.tensors[0], full.test.tensors[0]) for b in bundles)
    union, full_rows = Counter(), _rows(full.train)
    for b in bundles:
        union += _rows(b.train)
    assert sum(union.values()) == size * (len(full.train) // size)
    assert all(full_rows[k] >= v for k, v in union.items())  # disjoint sub-multiset of train
    again = build_datasets("digits", rank=1, size=size, seed=3)
    assert torch.equal(again.train.tensors[0], bundles[1].train.tensors[0])
    other = build_datasets("digits", rank=1, size=size, seed=4)
    assert not torch.equal(other.train.tensors[0], bundles[1].train.tensors[0])


def test_digits_split_is_sklearns_from_the_cache_and_a_bad_cache_file_is_rebuilt(tmp_path, monkeypatch):
    """The first launch computes scikit-learn's stratified split and keeps it; a later one reads it
    without importing scikit-learn (about 3 s a process) and gets the same arrays; an unreadable
    file is computed again and replaced."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from redsync_hvd.data import digits
    from redsync_hvd.data.base import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    direct = digits._sklearn_split(5, 0.25)
    y = load_digits().target.astype(np.int64)
    assert np.array_equal(direct[3], train_test_split(y, test_size=0.25, random_state=5, stratify=y)[1])
    first = digits.split(5, 0.25)
    [saved] = list(tmp_path.glob("digits-*seed5-test0.25.npz"))
    probe = ("import sys; from redsync_hvd.data import digits; p = digits.split(5, 0.25); "
             "print(int('sklearn' in sys.modules), float(p[0].sum()), int(p[3].sum()))")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, CACHE_ENV: str(tmp_path)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", str(float(first[0].sum())), str(int(first[3].sum()))], out
    saved.write_bytes(b"not a zip file")
    again = digits.split(5, 0.25)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(direct, again))
    assert all(np.array_equal(a, b) for a, b in zip(first, direct))
    assert np.load(saved)["y_test"].shape == direct[3].shape          # replaced by a readable file
    assert not [p for p in tmp_path.iterdir() if p != saved]            # no temporary file left


def test_digits_mlp_fits_training_shard():
    bundle = build_datasets("digits", rank=0, size=2, seed=0)
    x, y = bundle.train.tensors
    torch.manual_seed(0)
    model = build_model("mlp", bundle.num_classes, bundle.input_shape)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        assert (model(x).argmax(1) == y).float().mean() > 0.9
        xt, yt = bundle.test.tensors
        assert (model(xt).argmax(1) == yt).float().mean() > 0.8


def test_dataset_errors():
    with pytest.raises(ValueError, match="digits"):
        build_datasets("imagenet")
    with pytest.raises(TypeError, match="test_fractoin"):
        build_datasets("digits", test_fractoin=0.1)
    with pytest.raises(ValueError):
        build_datasets("digits", rank=2, size=2)
    assert set(DATASET_NAMES) >= {"digits", "synthetic", "synthetic_lm", "cifar10", "mnist", "ptb"}

# ----------------------------------------------------------------------------- synthetic


def test_synthetic_classification_learnable():
    b = build_datasets("synthetic", seed=1, num_samples=1000, num_test=300, input_shape=20,
                       num_classes=5)
    assert b.input_shape == (20,) and b.train[0][0].shape == (20,) and len(b.test) == 300
    x, y = b.train.tensors
    # nearest-class-mean classifier estimated from the train data
    means = torch.stack([x[y == c].mean(0) for c in range(5)])
    xt, yt = b.test.tensors
    assert (torch.cdist(xt, means).argmin(1) == yt).float().mean() > 0.75
    img = build_datasets("synthetic", num_samples=64, num_test=8)
    assert img.train[0][0].shape == (1, 8, 8)
    assert torch.equal(build_datasets("synthetic", seed=2).train.tensors[0],
                       build_datasets("synthetic", seed=2).train.tensors[0])


def test_synthetic_lm_shapes_and_structure():
    b = build_datasets("synthetic_lm", rank=0, size=2, vocab_size=50, num_tokens=5000,
                       seq_len=10, seed=0)
    assert b.task == "lm" and b.num_classes == 50 and b.input_shape == (10,)
    assert len(b.train) == (4999 // 10) // 2 and len(b.test) == (500 - 1) // 10
    x, t = b.train[0]
    assert x.shape == t.shape == (10,) and x.dtype == torch.int64
    assert torch.equal(x[1:], t[:-1])  # target is the input shifted by one token
    xs, ts = b.train.tensors
    pairs = set(zip(xs.reshape(-1).tolist(), ts.reshape(-1).tolist()))
    assert len(pairs) <= 50 * 4  # each token has at most `branching` successors
    model = build_model("lstm_lm", b.num_classes, b.input_shape, embed_dim=16, hidden=16)
    assert model(xs[:3]).shape == (3, 10, 50)

# ----------------------------------------------------------------------------- cifar10


def _write_cifar(folder, n_per_batch=4, n_test=6):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        n = n_test if name == "test_batch" else n_per_batch
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        data[0] = 255  # a known all-white first image per file
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": [(i + j) % 10 for j in range(n)],
                         b"batch_label": name.encode()}, f)


def test_cifar10_loader(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    _write_cifar(root)
    b = build_datasets("cifar10", path=str(root), rank=1, size=3, seed=0)
    assert b.num_classes == 10 and b.input_shape == (3, 32, 32) and len(b.test) == 6
    assert len(b.train) == 20 // 3
    x, y = b.test[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    white = (1.0 - torch.tensor([0.4914, 0.4822, 0.4465])) / torch.tensor([0.2470, 0.2435, 0.2616])
    assert torch.allclose(x[:, 0, 0], white, atol=1e-5)
    aug = build_datasets("cifar10", path=str(tmp_path), augment=True)  # parent folder works too
    assert len(aug.train) == 20 and aug.train[0][0].shape == (3, 32, 32)


def test_missing_path_messages(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        build_datasets("cifar10", path=str(tmp_path / "nope"))
    msg = str(e.value)
    for part in ("cifar10", "nope", "data_batch_1", "test_batch", "data.path", "data.name=digits"):
        assert part in msg
    with pytest.raises(FileNotFoundError, match="data.path"):
        build_datasets("cifar10")
    with pytest.raises(FileNotFoundError) as e:
        build_datasets("mnist", path=str(tmp_path))
    assert "mnist" in str(e.value) and "t10k-labels-idx1-ubyte" in str(e.value)
    (tmp_path / "ptb.train.txt").write_text("a b\n")
    with pytest.raises(FileNotFoundError, match="ptb.test.txt"):
        build_datasets("ptb", path=str(tmp_path))

# ----------------------------------------------------------------------------- mnist


def _write_idx(path, arr, magic, gz=False):
    payload = struct.pack(">I", magic) + struct.pack(">" + "I" * arr.ndim, *arr.shape) \
        + arr.astype(np.uint8).tobytes()
    with (gzip.open if gz else open)(path, "wb") as f:
        f.write(payload)


def test_mnist_loader(tmp_path):
    rng = np.random.default_rng(0)
    tr_x = rng.integers(0, 256, (10, 28, 28), dtype=np.uint8)
    te_x = rng.integers(0, 256, (4, 28, 28), dtype=np.uint8)
    _write_idx(tmp_path / "train-images-idx3-ubyte", tr_x, 2051)
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.arange(10) % 10, 2049, gz=True)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", te_x, 2051, gz=True)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 1, 4, 1]), 2049)
    b = build_datasets("mnist", path=str(tmp_path), rank=0, size=3, normalize=False)
    assert b.input_shape == (1, 28, 28) and len(b.train) == 3 and len(b.test) == 4
    x, y = b.test[2]
    assert x.shape == (1, 28, 28) and int(y) == 4
    assert torch.allclose(x[0], torch.from_numpy(te_x[2]).float() / 255)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([3, 1, 4, 1]), 2051)  # bad magic
    with pytest.raises(ValueError, match="magic"):
        build_datasets("mnist", path=str(tmp_path))

# ----------------------------------------------------------------------------- ptb


def test_ptb_loader(tmp_path):
    (tmp_path / "ptb.train.txt").write_text(" the cat sat \n the dog sat on the mat \n" * 5)
    (tmp_path / "ptb.valid.txt").write_text(" the bird sat \n" * 4)
    b = build_datasets("ptb", path=str(tmp_path), seq_len=4, rank=1, size=2)
    vocab = b.info["vocab"]
    assert b.task == "lm" and b.num_classes == len(vocab) and b.input_shape == (4,)
    assert vocab[:3] == ["the", "cat", "sat"] and "<eos>" in vocab and "<unk>" in vocab
    n_train = 5 * (4 + 7)  # words + <eos> per line
    assert len(b.train) == ((n_train - 1) // 4) // 2 and len(b.test) == (16 - 1) // 4
    x, t = b.test[0]
    words = [vocab[i] for i in x.tolist()]
    assert words == ["the", "<unk>", "sat", "<eos>"] and t[:3].tolist() == x[1:].tolist()
    model = build_model("lstm_lm", b.num_classes, b.input_shape, embed_dim=8, hidden=8)
    assert model(b.train.tensors[0]).shape == (len(b.train), 4, len(vocab))
