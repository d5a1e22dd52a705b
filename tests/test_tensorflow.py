"""TensorFlow 2 adapter: the same algorithm core behind redsync_hvd.tensorflow.

Real `horovodrun -np 2` jobs (tests/mp/tf_*.py) and end-to-end runs of
`python -m redsync_hvd.tensorflow.train` (`framework: tensorflow` configs). Skipped, with the reason, when
TensorFlow is not importable (install with `REDSYNC_WITH_TF=1 bash scripts/install.sh`;
`make test` does).
"""
import importlib.util
import json

import pytest
from launch import case_output, run_script, summary
from launch import train as launch_train


def _tf_missing():
    if importlib.util.find_spec("tensorflow") is None:
        return ("tensorflow is not importable: install it with REDSYNC_WITH_TF=1 bash scripts/install.sh "
                "(tensorflow-cpu==2.15.1 and a Horovod built with it; `make test` does)")
    return None


# With TensorFlow installed, a Horovod without its TF extension is an install bug (install.sh builds
# Horovod with TF whenever TF is there): tests/test_install.py's check-build test fails then.
pytestmark = pytest.mark.skipif(_tf_missing() is not None, reason=str(_tf_missing()))

TF_TIMEOUT = 300   # two TF + torch processes starting on two shared cores take a while


# -- install and in-process checks ----------------------------------------------------------------
def test_dlpack_hand_over_is_zero_copy():
    import numpy as np
    import tensorflow as tf
    import torch

    from redsync_hvd.tensorflow.dlpack import to_tf, to_torch

    g = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
    t = to_torch(g)
    assert t.shape == (3, 4) and t.dtype == torch.float32
    assert np.array_equal(t.numpy(), g.numpy())
    assert to_torch(g).data_ptr() == t.data_ptr()          # a view of TF's buffer, not a copy
    out = torch.zeros(5)
    back = to_tf(out)
    out[2] = 7.0                                          # TF sees torch's memory
    assert back.numpy()[2] == 7.0


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_keras_twin_computes_the_torch_model(name):
    import numpy as np
    import torch

    from redsync_hvd.models import build_model
    from redsync_hvd.tensorflow.models import build_keras_model

    kmodel, named, shape = build_keras_model(name, 10, (1, 8, 8), seed=3)
    torch.manual_seed(3)
    tmodel = build_model(name, 10, (1, 8, 8))
    assert [n for n, _ in named] == [n for n, _ in tmodel.named_parameters()]
    x = np.random.default_rng(0).random((6, 1, 8, 8)).astype(np.float32)
    ours = kmodel(x.transpose(0, 2, 3, 1)).numpy()
    ref = tmodel(torch.from_numpy(x)).detach().numpy()
    assert np.abs(ours - ref).max() < 1e-5


# -- real horovodrun jobs ---------------------------------------------------------------------------
# A parametrized test's cases run in one job (launch.case_output): each test checks its own lines.
DENSE_EQUALS_SINGLE = [   # [compression, mode]
    [{"method": "none"}, "eager"],
    [{"method": "none"}, "function"],
    [{"method": "none"}, "keras"],
    [{"method": "none"}, "fit"],
    [{"method": "topk", "density": 1.0}, "eager"],
    [
        {
            "method": "redsync",
            "density": 1.0,
            "message": {"quantize": "none"},
            "dgc": {"momentum_correction": False},
            "policy": {"min_compress_numel": 0},
            "selection": {"method": "tbs"},
        },
        "function",
    ],
]


@pytest.mark.parametrize("case", range(len(DENSE_EQUALS_SINGLE)))
def test_tf_dense_equals_single_process(case):
    out = case_output("tf_dense_equals_single.py", DENSE_EQUALS_SINGLE, case, timeout=2 * TF_TIMEOUT)
    assert out.count("OK tf") == 2, out


CROSS_FRAMEWORK = [
    {"method": "topk", "density": 0.01},
    {
        "method": "redsync",
        "local_steps": 1,   # TF exchanges every step; auto would take 8 local steps in torch
        "density": 0.01,
        "selection": {"method": "tbs", "threshold_reuse": 3},
        "message": {"quantize": "sign_mean"},
        "policy": {"min_compress_numel": 1000},
    },  # DGC momentum correction on (the default)
    {
        "method": "redsync",
        "local_steps": 1,
        "density": 0.02,
        "selection": {"method": "trimmed"},
        "message": {"quantize": "fp16", "index_coding": "golomb"},
        "dgc": {"momentum_correction": False},
        "policy": {"min_compress_numel": 0},
    },
    {
        "method": "redsync",
        "local_steps": 1,
        "density": 0.01,
        "selection": {"method": "sampled"},
        "dgc": {"momentum_correction": False},
    },
    {"method": "randomk", "density": 0.05},
    {
        "method": "iwp",
        "density": 0.05,
        "policy": {"min_compress_numel": 0},
    },  # the leader weighs by |w|: TF passes w too
    {"method": "fp16"},
]


@pytest.mark.parametrize("case", range(len(CROSS_FRAMEWORK)))
def test_same_config_selects_the_same_indices_in_torch_and_tf(case):
    out = case_output("tf_cross_framework.py", CROSS_FRAMEWORK, case, timeout=2 * TF_TIMEOUT)
    assert out.count("OK cross-framework") == 2, out


def test_init_can_start_horovod_tensorflow_too():
    """init() starts only horovod.torch's instance (every other TF job here runs that way);
    init(tensorflow_horovod=True) adds horovod.tensorflow's, for programs that call it.

    A process with both instances can segfault at exit after its work is done (docs/tensorflow.md,
    "Known issue"); that exit alone is accepted here, once both ranks printed their checks."""
    res = run_script("tf_two_instances.py", np=2, timeout=TF_TIMEOUT, check=False)
    out = res.stdout
    assert out.count("OK two instances agree (2 ranks)") == 2, out
    assert res.returncode == 0 or (res.returncode == 139 and "Segmentation fault" in out), out


def test_tf_bad_inputs_give_the_torch_errors():
    out = run_script("tf_errors.py", np=2, timeout=TF_TIMEOUT).stdout
    for what in (
        "OK bad compression dicts",
        "OK zero-size variable",
        "OK sbc, decentralized and momentum_correction errors",
        "eager raised at step 2",
        "function raised at step 2",
        "OK nonfinite handling",
    ):
        assert out.count(what) == 2, (what, out[-3000:])


# -- python -m redsync_hvd.train with framework: tensorflow ---------------------------------------
def train(tmp_path, config, *overrides, np=2, check=True, timeout=600, module=None):
    """TF configs run `python -m redsync_hvd.tensorflow.train` directly (`redsync_hvd.train`
    dispatches to it, which test_main_cli_dispatches_tensorflow_configs checks); others the torch trainer."""
    if module is None:
        module = "redsync_hvd.tensorflow.train" if "tf-" in config else "redsync_hvd.train"
    return launch_train(tmp_path, config, *overrides, np=np, check=check, timeout=timeout, module=module)


TF_SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def tf_digits_runs(tmp_path_factory):
    """TF dense and TF RedSync at density 0.01 (configs/digits/tf-redsync.yaml: sign_mean
    messages, TBS, warm-up) on the digits CNN, 2 workers, 40 epochs (RedSync's documented
    convergence setting, as for torch), seeds 0-2."""
    out = tmp_path_factory.mktemp("tf_runs")
    for seed in TF_SEEDS:
        for cfg in ("tf-dense", "tf-redsync"):
            train(out, f"configs/digits/{cfg}.yaml", "training.epochs=40", f"training.seed={seed}",
                  f"output.name={cfg}" + ("" if seed == 0 else f"-s{seed}"))
    return out


def test_tf_redsync_accuracy_close_to_tf_dense(tf_digits_runs):
    """TF with RedSync at density 0.01 within 0.5 point of TF dense at the same epochs (40), on
    the mean of seeds 0-2 (paired: same seed and split; 360 test samples, one sample = 0.28
    point). At 20 epochs sign_mean is still catching up, in both frameworks. Measured figures:
    docs/tensorflow.md."""
    def mean(name):
        runs = [summary(tf_digits_runs / (name + ("" if s == 0 else f"-s{s}"))) for s in TF_SEEDS]
        return sum(r["final_accuracy"] for r in runs) / len(runs), runs
    dense, dense_runs = mean("tf-dense")
    rs, rs_runs = mean("tf-redsync")
    assert dense >= 0.9, dense
    assert rs >= dense - 0.005, (rs, dense)
    assert all(r["compression_ratio"] > 30 for r in rs_runs)
    assert all(0.99 < r["compression_ratio"] <= 1.0 for r in dense_runs)
    decisions = {d["name"]: d["compressed"] for d in rs_runs[0]["layer_decisions"]}
    assert decisions["classifier.1.weight"] and not decisions["classifier.1.bias"]


def test_tf_run_folder_has_the_torch_keys(tf_digits_runs, tmp_path):
    """summary.json and metrics.jsonl of a TF run carry the same keys as a torch run's."""
    train(tmp_path, "configs/digits/redsync.yaml", "training.steps=20", "compression.local_steps=1",
          "output.name=torch")   # every step, as TF runs it (auto is 8 local steps under torch)
    train(tmp_path, "configs/digits/tf-redsync.yaml", "training.steps=20", "output.name=tf")
    t, f = summary(tmp_path / "torch"), summary(tmp_path / "tf")
    assert set(t) == set(f), set(t) ^ set(f)
    assert set(t["time_breakdown"]) == set(f["time_breakdown"])
    assert t["dense_bytes"] == f["dense_bytes"]                 # same model, same number of steps
    assert t["layer_decisions"] == f["layer_decisions"]         # same names, sizes, decisions
    for run in ("torch", "tf"):
        assert (tmp_path / run / "checkpoint-rank0.pt").is_file() and (tmp_path / run / "config.yaml").is_file()

    def keys(run):
        lines = [json.loads(l) for l in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return ({k for l in lines if "test_accuracy" not in l for k in l},
                {k for l in lines if "test_accuracy" in l for k in l})
    assert keys("torch") == keys("tf")
    # same initial weights, batches, update rule and compression: the same losses, up to float rounding
    losses = {run: [json.loads(l)["loss"] for l in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
                    if '"loss"' in l] for run in ("torch", "tf")}
    assert len(losses["tf"]) == len(losses["torch"]) == 2
    assert all(abs(a - b) < 1e-3 for a, b in zip(losses["torch"], losses["tf"])), losses
    lines = (tf_digits_runs / "tf-dense" / "metrics.jsonl").read_text().splitlines()
    assert sum("test_accuracy" in l for l in lines) == 40


def test_tf_resume_continues_identically(tmp_path):
    """A TF run interrupted at step 30 and resumed ends where the uninterrupted run ends,
    residuals included."""
    import numpy as np
    import torch

    from redsync_hvd import checkpoint
    common = ["training.steps=60", "training.eval_every=30", "compression.density=0.05"]
    train(tmp_path, "configs/digits/tf-topk.yaml", *common, "training.checkpoint_every=30", "output.name=full")
    train(tmp_path, "configs/digits/tf-topk.yaml", *common, "output.name=resumed",
          f"training.resume={tmp_path}/full/checkpoint-step30-rank{{rank}}.pt")
    for rank in (0, 1):
        a, b = checkpoint.load(tmp_path / "full", rank), checkpoint.load(tmp_path / "resumed", rank)
        assert a["step"] == b["step"] == 60
        for k in a["model"]:
            assert np.allclose(a["model"][k], b["model"][k], atol=1e-6), k
        ra, rb = a["redsync"]["memory"]["residual"], b["redsync"]["memory"]["residual"]
        assert ra.keys() == rb.keys() and all(torch.allclose(ra[k], rb[k], atol=1e-6) for k in ra)
        assert any(v.abs().sum() > 0 for v in ra.values())


def test_tf_unsupported_model_is_a_clear_error(tmp_path):
    res = train(tmp_path, "configs/digits/tf-dense.yaml", "model.name=resnet20", check=False, timeout=TF_TIMEOUT)
    assert res.returncode != 0
    assert "framework: tensorflow supports the models" in res.stdout, res.stdout[-2000:]


def test_main_cli_dispatches_tensorflow_configs(tmp_path):
    res = train(tmp_path, "configs/digits/tf-mlp-dense.yaml", "training.steps=5", module="redsync_hvd.train",
                timeout=TF_TIMEOUT)
    assert "(framework tensorflow)" in res.stdout and (tmp_path / "tf-mlp-dense" / "summary.json").is_file()
