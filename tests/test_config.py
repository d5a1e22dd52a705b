"""Config schema: defaults, base files, overrides and the errors users see."""
from pathlib import Path

import pytest

from redsync_hvd.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parent.parent


def test_repo_configs_validate():
    files = sorted((REPO / "configs").rglob("*.yaml"))
    assert files
    for f in files:
        if f.name == "base.yaml" or "bench" in f.parts or "sweeps" in f.parts:   # not run configs
            continue
        cfg = load_config(f)
        assert cfg.output.name == f.stem


def test_base_file_is_overridden(tmp_path):
    (tmp_path / "base.yaml").write_text("model: {name: mlp}\ntraining: {epochs: 3, batch_size: 16}\n")
    (tmp_path / "run.yaml").write_text("base: base.yaml\ntraining: {epochs: 5}\ncompression: {method: topk}\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.model.name == "mlp" and cfg.training.epochs == 5 and cfg.training.batch_size == 16
    assert cfg.compression.method == "topk" and cfg.compression.density == 0.01


def test_cli_overrides_use_the_same_names():
    cfg = load_config(REPO / "configs/digits/topk.yaml", ["compression.density=0.001", "training.seed=7"])
    assert cfg.compression.density == 0.001 and cfg.training.seed == 7
    cfg = load_config(REPO / "configs/digits/topk.yaml", ["compression.method=fp16"])
    assert cfg.compression.method == "fp16"


@pytest.mark.parametrize("overrides, words", [
    (["compression.density=1.5"], ["density", "(0, 1]"]),
    (["compression.density=0"], ["density", "(0, 1]"]),
    (["compression.densty=0.1"], ["densty", "unknown key", "density"]),
    (["compression.method=magic"], ["magic", "topk"]),
    (["training.epoch=3"], ["training.epoch", "unknown key"]),
    (["optimizer.lr=-1"], ["optimizer.lr"]),
    (["training.batch_size=abc"], ["training.batch_size"]),
    (["nonsense"], ["section.key=value"]),
])
def test_bad_values_name_field_and_fix(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/digits/topk.yaml", overrides)
    for w in words:
        assert w in str(info.value), str(info.value)


def test_unknown_top_level_section():
    with pytest.raises(ConfigError, match="modle"):
        validate({"modle": {"name": "cnn"}})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize("where", ["file", "set"])
def test_yaml_syntax_errors_name_the_place(tmp_path, where):
    if where == "file":
        (tmp_path / "bad.yaml").write_text("model:\n  name: cnn\ntraining: {epochs: 3\n")
        with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML: .* at line 4, column 1 .*line 3"):
            load_config(tmp_path / "bad.yaml")
    else:
        with pytest.raises(ConfigError, match=r"override 'model.name=\[x': its value is not valid YAML .*quote it"):
            load_config(REPO / "configs/digits/topk.yaml", ["model.name=[x"])


def test_cli_config_errors_exit_2_with_one_line_and_no_traceback(tmp_path, capsys):
    from redsync_hvd.train import main
    (tmp_path / "tab.yaml").write_text("model:\n\tname: cnn\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    cases = [(["--config", str(REPO / "configs/digits/topk.yaml"), "--set", "model.name=nope"],
              "model.name: 'nope' is not one of: mlp, cnn, resnet20, vgg, lstm_lm"),
             (["--config", str(tmp_path / "tab.yaml")], "found character '\\t' that cannot start any token at line 2"),
             (["--config", str(tmp_path / "binary.yaml")], "cannot read"),
             (["--config", str(tmp_path)], "is a folder, not a YAML file")]
    for argv, words in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, err


def test_experiment_fingerprint_ignores_what_a_resume_may_change():
    a = load_config(REPO / "configs/digits/topk.yaml")
    b = load_config(REPO / "configs/digits/topk.yaml", ["training.resume=runs/x", "output.name=y",
                                                        "training.epochs=40", "training.on_resize=sum",
                                                        "training.checkpoint_every_s=5"])
    assert a.fingerprint() != b.fingerprint() and a.experiment_fingerprint() == b.experiment_fingerprint()
    c = load_config(REPO / "configs/digits/topk.yaml", ["optimizer.lr=0.2"])
    assert a.experiment_fingerprint() != c.experiment_fingerprint()


def test_fingerprint_changes_with_any_knob():
    a = load_config(REPO / "configs/digits/topk.yaml")
    b = load_config(REPO / "configs/digits/topk.yaml", ["compression.density=0.02"])
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == load_config(REPO / "configs/digits/topk.yaml").fingerprint()


def test_configuration_reference_is_up_to_date():
    import subprocess
    import sys
    res = subprocess.run([sys.executable, str(REPO / "scripts/gen_config_docs.py"), "--check"], capture_output=True,
                         text=True, cwd=REPO, env={"PYTHONPATH": str(REPO)})
    assert res.returncode == 0, res.stderr


def test_a_partial_policy_keeps_the_methods_size_floor():
    """RedSync's and IWP's floor (layers under 4096 elements go dense) holds when a config gives
    policy.layers but leaves min_compress_numel out; a value given, or the cost model, wins."""
    from redsync_hvd.config.compression import parse_compression
    layers = {"layers": [{"pattern": "embedding.*", "density": 0.01}]}
    for method in ("redsync", "iwp"):
        assert parse_compression({"method": method, "policy": layers}).policy.min_compress_numel == 4096
        assert parse_compression({"method": method, "policy": {**layers, "min_compress_numel": 0}}) \
            .policy.min_compress_numel == 0
    assert parse_compression({"method": "redsync", "policy": "cost_model"}).policy.min_compress_numel == 0
    assert parse_compression({"method": "topk", "policy": layers}).policy.min_compress_numel == 0
