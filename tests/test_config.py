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
    (["compression.policy.compute_s=[-1e-4, 1e-9]"], ["policy.compute_s", "seconds per layer, seconds per element"]),
    (["compression.policy.compute_s=[1e-4]"], ["compute_s"]),
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


@pytest.mark.parametrize("override, key, guess", [
    ("modle.name=cnn", "modle", "model"),
    ("model.nme=cnn", "model.nme", "model.name"),
    ("data.nam=digits", "data.nam", "data.name"),
    ("optimizer.momentm=0.5", "optimizer.momentm", "optimizer.momentum"),
    ("optimizer.schedule.gama=0.5", "optimizer.schedule.gama", "optimizer.schedule.gamma"),
    ("training.epoch=3", "training.epoch", "training.epochs"),
    ("output.nam=x", "output.nam", "output.name"),
    ("compression.densty=0.1", "compression.densty", "compression.density"),
    ("compression.selection.methd=tbs", "compression.selection.methd", "compression.selection.method"),
    ("compression.policy.layers=[{patern: fc}]", "compression.policy.layers[0].patern",
     "compression.policy.layers[0].pattern"),
])
def test_unknown_keys_in_every_section_list_the_valid_ones_and_the_closest(override, key, guess):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/digits/redsync.yaml", [override])
    text = str(info.value)
    assert text.startswith(f"invalid configuration in --set {override}: {key}: unknown key; did you mean {guess}? "
                           "Valid keys of "), text
    section = guess.rpartition(".")[2]
    assert section in text.split("Valid keys of ", 1)[1] and "\n" not in text, text


def test_the_header_names_the_file_the_base_file_or_the_set_that_gave_the_value(tmp_path):
    (tmp_path / "base.yaml").write_text("model: {name: cnn}\ntraining: {epochz: 3}\n")
    (tmp_path / "run.yaml").write_text("base: base.yaml\ntraining: {batch_sise: 8}\n")
    (tmp_path / "own.yaml").write_text("training: {batch_sise: 8}\n")
    for path, overrides, origin in [
            (tmp_path / "base.yaml", [], f"{tmp_path / 'base.yaml'}: training.epochz"),
            (tmp_path / "run.yaml", [], f"{tmp_path / 'base.yaml'} (the base: of {tmp_path / 'run.yaml'}): "
                                        "training.epochz"),
            (tmp_path / "own.yaml", [], f"{tmp_path / 'own.yaml'}: training.batch_sise"),
            (tmp_path / "own.yaml", ["training.batch_sise=4"], "--set training.batch_sise=4: training.batch_sise")]:
        with pytest.raises(ConfigError) as info:
            load_config(path, overrides)
        assert str(info.value).startswith(f"invalid configuration in {origin}: unknown key; did you mean"), info.value
    (tmp_path / "orphan.yaml").write_text("base: ../nowhere/base.yaml\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "orphan.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'orphan.yaml'}: its base: file not found: "
                                      f"{tmp_path.parent / 'nowhere' / 'base.yaml'}. Point base: at"), info.value


@pytest.mark.parametrize("overrides, words", [
    (["model.name=lstm_lm"], ["--set model.name=lstm_lm and ", "'lstm_lm' is a language model", "'digits' holds images",
                              "pydoc", "cnn"]),
    (["data.name=pydoc"], ["and --set data.name=pydoc:", "'cnn' is an image model", "'pydoc' holds token ids",
                           "lstm_lm", "digits"]),
])
def test_a_model_that_cannot_read_the_data_stops_before_training(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/digits/redsync.yaml", overrides)
    for w in words:
        assert w in str(info.value), str(info.value)
    load_config(REPO / "configs/digits/redsync.yaml", ["model.name=lstm_lm", "data.name=synthetic_lm"])


def test_the_task_of_each_dataset_name_is_the_one_its_builder_gives():
    """LM_DATASETS (what the config check calls token data) against the builders themselves, on the
    datasets that need no files."""
    from redsync_hvd.config.run import LM_DATASETS
    from redsync_hvd.data import build_datasets
    for name in ("digits", "synthetic", "synthetic_lm", "pydoc"):
        assert (build_datasets(name).task == "lm") == (name in LM_DATASETS), name


def test_a_run_folder_of_another_run_stops_the_launch_with_the_three_ways_on(tmp_path, capsys):
    """Before any framework starts: one line that names resume, another name and overwrite; a
    resume of that folder goes on; overwrite with a resume of the same folder is refused."""
    from redsync_hvd.train import main
    run = tmp_path / "redsync"
    run.mkdir()
    for name in ("config.yaml", "metrics.jsonl", "checkpoint-rank0.pt", "checkpoint-rank1.pt", "notes.txt"):
        (run / name).write_text("x")
    argv = ["--config", str(REPO / "configs/digits/redsync.yaml"), "--set", f"output.dir={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "notes.txt" not in err, err
    assert err.startswith(f"error: {run} holds the files of another run (checkpoint-rank0.pt, checkpoint-rank1.pt, "
                          "config.yaml, metrics.jsonl)"), err
    for way in (f"--set training.resume={run}", "--set output.name=", "--set output.overwrite=true"):
        assert way in err, err
    assert main(argv + ["--set", f"training.resume={run}", "--set", "output.overwrite=true"]) == 2
    assert "output.overwrite=true would delete the checkpoints that training.resume" in capsys.readouterr().err
    from redsync_hvd.train import folder_problem
    assert folder_problem(load_config(REPO / "configs/digits/redsync.yaml",
                                      [f"output.dir={tmp_path}", f"training.resume={run}"])) is None
    assert folder_problem(load_config(REPO / "configs/digits/redsync.yaml",
                                      [f"output.dir={tmp_path}", "output.overwrite=true"])) is None
    assert folder_problem(load_config(REPO / "configs/digits/redsync.yaml",
                                      [f"output.dir={tmp_path}", "output.name=other"])) is None


def test_clearing_a_run_folder_takes_every_ranks_checkpoints_and_only_the_runs_files(tmp_path):
    from redsync_hvd.runlog import clear_run
    names = ["config.yaml", "metrics.jsonl", "summary.json", "decisions.json", "layers.log", "checkpoint-rank0.pt",
             "checkpoint-rank0.pt.prev", "checkpoint-rank1.pt", "checkpoint-step6-rank1.pt", "checkpoint-rank12.pt",
             ".checkpoint-rank1.pt.x1.tmp", "notes.txt"]
    for name in names:
        (tmp_path / name).write_text("x")
    assert clear_run(tmp_path, 1) == 3          # another rank: its own checkpoints only
    assert not (tmp_path / "checkpoint-rank1.pt").exists() and (tmp_path / "checkpoint-rank12.pt").exists()
    assert clear_run(tmp_path, 0) == len(names) - 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def _cell_defaults(cell: str, methods: list) -> dict:
    """A default cell of docs/configuration.md -> {method: repr}: "`V`" or "`V`; m1, m2: `W`; ..."."""
    first, *others = cell.split("; ")
    out = {m: first.strip("`") for m in methods}
    for part in others:
        names, _, value = part.partition(": ")
        out.update({m.strip(): value.strip("`") for m in names.split(",")})
    return out


def _lookup(obj, dotted: str):
    *parents, last = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    value = getattr(obj, last)
    # as a config file writes it: an ``auto`` the config resolved to a number is written back as auto
    written = obj.model_dump().get(last, value) if hasattr(obj, "model_dump") else value
    return written if written == "auto" else value


def test_every_default_in_the_configuration_reference_is_the_models():
    """docs/configuration.md read as a user reads it: each row's default, for each method its table or
    cell names, is what the schema builds for that method (RedSync's momentum correction and size
    floor included); a key without a default says "required"."""
    import re

    from redsync_hvd.config import RunConfig, method_names, parse_compression
    from redsync_hvd.config.compression import CompressionConfig, LayerOverride
    built = {m: parse_compression({"method": m}) for m in method_names()}
    exchange = [m for m, c in built.items() if isinstance(c, CompressionConfig)]
    run, methods, checked = RunConfig(), [], 0
    for line in (REPO / "docs/configuration.md").read_text().splitlines():
        if line.startswith("#"):
            named = re.search(r"`method: ([^`]+)`|\(([a-z0-9_, ]+)\)$", line)
            methods = ([m.strip() for m in re.split(r"[|,]", named.group(1) or named.group(2))] if named
                       else exchange)
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        key, cell = cells[0].strip("`"), cells[2]
        if key.startswith("layers[]."):
            found = {"": LayerOverride(pattern="x")}
            path, methods_here = key.removeprefix("layers[]."), [""]
        elif key.startswith("compression."):
            found, path, methods_here = built, key.removeprefix("compression."), methods
        else:
            found, path, methods_here = {"": run}, key, [""]
        if cell == "required":
            model = type(_lookup(found[methods_here[0]], path.rpartition(".")[0])) if "." in path else \
                type(found[methods_here[0]])
            assert model.model_fields[path.rpartition(".")[2]].is_required(), key
            continue
        for method, shown in _cell_defaults(cell, methods_here).items():
            assert shown == repr(_lookup(found[method], path)), (key, method, shown)
            checked += 1
    assert checked > 150, checked
    text = (REPO / "docs/configuration.md").read_text()
    assert "PydanticUndefined" not in text
    assert "| `compression.dgc.momentum_correction` | bool | `False`; redsync: `True` |" in text
    assert "| `compression.policy.min_compress_numel` | int | `0`; dct, iwp, redsync: `4096` |" in text


# -- RedSync configs say why they leave the method's defaults --------------------------------
def _words(text: str) -> str:
    """Lower case without spaces, hyphens and underscores: "warm-up" names warmup."""
    return "".join(c for c in text.lower() if c not in " _-")


def _leaves(section: dict, prefix: tuple = ()) -> list:
    """(path of keys, value) of every leaf of a compression section as the file wrote it."""
    out = []
    for key, value in section.items():
        if isinstance(value, dict):
            out += _leaves(value, prefix + (key,))
        else:
            out.append((prefix + (key,), value))
    return out


def _unexplained(path: Path) -> list:
    """The compression keys ``path`` sets beyond method and density that none of its comments names
    (by the key, any key above it, or the value it sets)."""
    import yaml
    text = path.read_text()
    comments = _words(" ".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line))
    section = (yaml.safe_load(text) or {}).get("compression") or {}
    missing = []
    for keys, value in _leaves(section):
        if keys in (("method",), ("density",)):
            continue
        names = [_words(k) for k in keys] + ([_words(str(value))] if isinstance(value, str) else [])
        if not any(n in comments for n in names):
            missing.append(".".join(keys))
    return missing


def test_redsync_configs_set_only_the_density_unless_a_comment_says_why():
    """A task's RedSync config takes the method's defaults: each other compression key it sets is
    named in one of its comments, which says why that work needs it."""
    found = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        if "bench" in path.parts or "sweeps" in path.parts or load_config(path).compression.method != "redsync":
            continue
        found.append(path)
        missing = _unexplained(path)
        assert not missing, f"{path.relative_to(REPO)} sets {missing} without a comment that says why"
    assert len(found) >= 6, found


def test_an_unexplained_key_fails_the_rule(tmp_path):
    bare = tmp_path / "redsync.yaml"
    bare.write_text("compression:\n  method: redsync\n  density: 0.01\n  warmup: {epochs: 4}\n")
    assert _unexplained(bare) == ["warmup.epochs"]
    bare.write_text("# a warm-up of 4 epochs: the first steps move the weights most\n" + bare.read_text())
    assert _unexplained(bare) == []


def test_an_auto_setting_is_the_experiment_it_was_before_it_was_auto():
    """A checkpoint keeps the experiment's fingerprint; one written when threshold_reuse and
    sparse_update were numbers and booleans must resume into the same config read now, where
    they default to auto: each is recorded as what it means for the run's state. Under the cost
    model the threshold reuse became 5, which is another experiment than the old default's 1."""
    static = load_config(REPO / "configs/digits/topk.yaml").experiment()["compression"]
    assert static["sparse_update"] is False
    redsync = load_config(REPO / "configs/digits/redsync.yaml", ["compression.selection.threshold_reuse=auto"])
    assert redsync.to_dict()["compression"]["selection"]["threshold_reuse"] == "auto"
    assert redsync.experiment()["compression"]["selection"]["threshold_reuse"] == 1
    chosen = load_config(REPO / "configs/digits/redsync.yaml", ["compression.selection.threshold_reuse=auto",
                                                                "compression.policy.mode=cost_model"])
    assert chosen.experiment()["compression"]["selection"]["threshold_reuse"] == 5
    assert chosen.experiment()["compression"]["sparse_update"] == "auto"
    assert redsync.experiment_fingerprint() != chosen.experiment_fingerprint()


def test_local_steps_keep_momentum_local_and_name_what_cannot_apply():
    """RedSync's and top-k's local_steps: the delayed step of SBC, on PyTorch under Horovod and DDP;
    DGC's correction (RedSync's default) goes off with it unless named, and what acts on every
    step's gradient is refused with the fix."""
    from redsync_hvd.config import parse_compression
    from redsync_hvd.engine.build import refuse

    on = parse_compression({"method": "redsync", "local_steps": 8, "density": 0.1})
    assert on.delayed and not on.corrects_momentum and not on.in_update_units and on.engines == ("horovod", "ddp")
    off = parse_compression({"method": "redsync"})
    assert not off.delayed and off.corrects_momentum and off.in_update_units and "ddp" in off.engines
    for bad, named in [({"dgc": {"momentum_correction": True}}, "dgc.momentum_correction"),
                       ({"feedback_units": "update"}, "feedback_units: update"),
                       ({"sparse_update": True}, "sparse_update: true")]:
        with pytest.raises(ValueError, match="local_steps: 1") as info:
            parse_compression({"method": "redsync", "local_steps": 4, **bad})
        assert named in str(info.value)
    for framework, engine in [("torch", "fsdp"), ("tensorflow", "horovod")]:
        with pytest.raises(ValueError, match="local steps"):
            refuse(on, framework, engine)
    refuse(on, "torch", "horovod")
    refuse(on, "torch", "ddp")
    for aggregation in ("sparse_reduce_scatter", "auto"):   # the round's deltas meet by either path
        assert parse_compression({"method": "redsync", "local_steps": 4, "aggregation": aggregation}).delayed


def test_local_steps_auto_settles_where_the_exchange_is_built():
    """``local_steps: auto`` (RedSync's default): 8 steps under PyTorch's Horovod optimizer and the DDP
    hook with an
    exchange of 8 x density but at least 0.1 (the default's too, after a dump and a second parse),
    Golomb-coded positions, int8 values under SGD, one shared Adam variance under Adam, and DGC's
    correction off;
    every step, with the config as written, on the other engines or with a per-step knob set; a
    word that is not auto is refused with the fix."""
    from redsync_hvd.config import exchange_every, parse_compression
    from redsync_hvd.config.compression import AUTO_EXCHANGE_DENSITY, AUTO_LOCAL_STEPS
    from redsync_hvd.engine.build import refuse

    auto = parse_compression({"method": "redsync", "local_steps": "auto", "density": 0.002})
    assert not auto.delayed and "ddp" in auto.engines   # unsettled: what every engine can run
    here = auto.settle("torch", "horovod")
    assert (here.local_steps, here.density, here.corrects_momentum) == (AUTO_LOCAL_STEPS, 0.1, False)
    assert (auto.message.index_coding, here.message.index_coding) == ("raw", "golomb")
    radix = parse_compression({"method": "redsync", "selection": "radix"}).settle("torch", "horovod")
    assert (radix.local_steps, radix.message.index_coding) == (AUTO_LOCAL_STEPS, "raw")   # radix stays on device
    # int8 values under SGD, fp16 under any other optimizer; other values, radix and every step keep theirs
    assert (here.message.quantize, auto.settle("torch", "horovod", sgd=True).message.quantize) == ("fp16", "int8")
    assert parse_compression({"method": "redsync", "message": {"quantize": "none"}}).settle(
        "torch", "horovod", sgd=True).message.quantize == "none"
    assert parse_compression({"method": "redsync", "selection": "radix"}).settle(
        "torch", "horovod", sgd=True).message.quantize == "fp16"
    # FSDP2 exchanges every step, with int8 values under SGD as well (docs/fsdp.md, "Measured")
    assert (auto.settle("torch", "fsdp", sgd=True).message.quantize, auto.settle("torch", "fsdp").message.quantize,
            auto.settle("torch", "fsdp", adam=True).message.quantize) == ("int8", "fp16", "fp16")
    assert parse_compression({"method": "redsync", "message": {"quantize": "none"}}).settle(
        "torch", "fsdp", sgd=True).message.quantize == "none"
    for aggregation in ("sparse_reduce_scatter", "auto"):   # coded per owner, decoded before the owners sum
        scatter = parse_compression({"method": "redsync", "aggregation": aggregation}).settle(
            "torch", "horovod", sgd=True)
        assert (scatter.local_steps, scatter.message.index_coding, scatter.message.quantize) == (
            AUTO_LOCAL_STEPS, "golomb", "int8")
    assert auto.settle("torch", "ddp", sgd=True) == auto.settle("torch", "horovod", sgd=True)   # the hook steps too
    # under Adam/AdamW one shared variance, sent factored; a variance given, or every step, keeps its own
    assert (here.adam_variance, auto.settle("torch", "horovod", adam=True).adam_variance) == ("own", "shared_factored")
    assert parse_compression({"method": "redsync", "adam_variance": "of_average"}).settle(
        "torch", "horovod", adam=True).adam_variance == "of_average"
    assert auto.settle("torch", "fsdp", adam=True).adam_variance == "own"
    assert auto.settle("torch", "ddp", adam=True).adam_variance == "shared_factored"
    budget = parse_compression({"method": "redsync", "selection": "radix", "policy": {"mode": "budget"}})
    assert budget.settle("torch", "horovod").local_steps == 1 and budget.per_step_knobs() == ["policy.mode: budget"]
    more = parse_compression({"method": "redsync", "local_steps": "auto", "density": 0.05})
    assert more.settle("torch", "horovod").density == 0.4   # a density that asks for more than 0.1 an exchange
    refuse(here, "torch", "horovod")
    assert auto.settle("torch", "horovod", elastic=True).local_steps == 1   # Elastic's reset broadcasts one model
    for framework, engine in [("torch", "fsdp"), ("tensorflow", "horovod")]:
        there = auto.settle(framework, engine)
        assert (there.local_steps, there.density, there.corrects_momentum) == (1, 0.002, True)
        refuse(there, framework, engine)
    named = parse_compression({"method": "redsync", "local_steps": "auto", "dgc": {"momentum_correction": True}})
    again = parse_compression(named.model_dump(mode="json"))   # how a run config reaches the optimizer
    for config in (named, again):
        here = config.settle("torch", "horovod")
        assert here.local_steps == AUTO_LOCAL_STEPS and not here.corrects_momentum and config.corrects_momentum
    masked = parse_compression({"method": "redsync", "local_steps": "auto", "dgc": {"momentum_masking": False}})
    assert masked.corrects_momentum and masked.settle("torch", "horovod").local_steps == AUTO_LOCAL_STEPS
    clipped = parse_compression({"method": "redsync", "local_steps": "auto", "dgc": {"clip_norm": 1.0}})
    assert clipped.settle("torch", "horovod").local_steps == 1 and clipped.per_step_knobs() == ["dgc.clip_norm"]
    unset = parse_compression({"method": "redsync"})   # auto is RedSync's default
    assert unset.local_steps == "auto" and parse_compression({"method": "topk"}).local_steps == 1
    for config in (unset, parse_compression(unset.model_dump(mode="json"))):   # as the runner hands it over
        assert config.settle("torch", "horovod").density == AUTO_EXCHANGE_DENSITY
    assert parse_compression({"method": "redsync", "local_steps": "auto"}).settle("torch", "fsdp").density == 0.001
    assert parse_compression({"method": "topk", "local_steps": "auto", "density": 0.5}).settle(
        "torch", "horovod").density == 1.0   # an exchange sends at most the whole delta
    assert [exchange_every(c) for c in ({"method": "redsync", "local_steps": "auto"}, {"method": "sbc"},
                                        {"method": "redsync", "local_steps": 1}, None)] == [AUTO_LOCAL_STEPS, 10, 1, 1]
    assert exchange_every({"method": "redsync", "local_steps": "auto"}, "torch", "fsdp") == 1
    assert exchange_every({"method": "redsync", "local_steps": "auto"}, "torch", "ddp") == AUTO_LOCAL_STEPS
    assert parse_compression({"method": "redsync", "local_steps": 4}).settle("torch", "ddp").local_steps == 4
    for bad in ("sometimes", 0):
        with pytest.raises(ValueError, match="local_steps"):
            parse_compression({"method": "redsync", "local_steps": bad})
    with pytest.raises(ValueError, match="set local_steps"):
        parse_compression({"method": "redsync", "local_steps": 1, "local_decay": 0.9})
    assert parse_compression({"method": "redsync", "local_steps": "auto", "local_decay": 0.9}).settle(
        "torch", "horovod").local_decay == 0.9


def test_local_steps_search_each_exchange_afresh_where_the_cost_model_chose_threshold_reuse():
    """settle's rule 8: ``threshold_reuse: auto`` (5 under the cost model) becomes 1 where auto takes
    local steps, and layers.log says why; a reuse given, a static policy, and the exchange every step
    (FSDP2, Elastic, rule 7) keep what they had."""
    from redsync_hvd.config import parse_compression
    from redsync_hvd.config.compression import AUTO_EVERY_STEP_SENDS, AUTO_LOCAL_STEPS
    from redsync_hvd.engine.build import auto_notes

    chosen = parse_compression({"method": "redsync", "policy": {"mode": "cost_model"}})
    assert chosen.selection.threshold_reuse == 5 and chosen.selection.reuse_chosen
    for engine in ("horovod", "ddp"):
        local = chosen.settle("torch", engine, sgd=True)
        assert (local.local_steps, local.selection.threshold_reuse) == (AUTO_LOCAL_STEPS, 1), engine
        assert local.selection.reuse_chosen and local.model_dump(mode="json")["selection"]["threshold_reuse"] == "auto"
    assert "(auto under local steps)" in auto_notes(chosen.settle("torch", "horovod"))[0]
    assert "searched every 5 steps" in auto_notes(chosen)[0]
    every = [chosen.settle("torch", "fsdp"), chosen.settle("torch", "horovod", elastic=True),
             parse_compression({"method": "redsync", "density": 0.005, "policy": {"mode": "cost_model"}}).settle(
                 "torch", "horovod", adam=True, steps=AUTO_EVERY_STEP_SENDS * 200)]
    assert [(c.local_steps, c.selection.threshold_reuse) for c in every] == [(1, 5)] * 3
    given = parse_compression({"method": "redsync", "selection": {"threshold_reuse": 5}, "policy": "cost_model"})
    assert given.settle("torch", "horovod").selection.threshold_reuse == 5   # a number given is kept
    static = parse_compression({"method": "redsync"})
    assert static.settle("torch", "horovod").selection == static.selection   # static: 1 already


def test_auto_under_adam_runs_every_step_in_gradient_units_when_the_run_sends_each_layer_often():
    """``local_steps: auto`` under Adam with the run's length given: from ``AUTO_EVERY_STEP_SENDS``
    sends of a whole layer (density x steps) on, an exchange every step in gradient units with
    Golomb positions (raw under radix) and the dense layers in fp16; below it, or without a
    length, under SGD, on FSDP2, or with local_steps set, the rules as before."""
    from redsync_hvd.config import parse_compression
    from redsync_hvd.config.compression import AUTO_EVERY_STEP_SENDS, AUTO_LOCAL_STEPS
    from redsync_hvd.torch.delayed import local_auto_note

    auto = parse_compression({"method": "redsync", "density": 0.005})
    long = AUTO_EVERY_STEP_SENDS * 200   # 50 sends at 0.005
    every = auto.settle("torch", "horovod", adam=True, steps=long)
    assert (every.local_steps, every.feedback_units, every.message.index_coding, every.policy.dense_values,
            every.density, every.message.quantize) == (1, "gradient", "golomb", "fp16", 0.005, "fp16")
    assert auto.settle("torch", "ddp", adam=True, steps=long) == every
    note = local_auto_note(every, long)
    assert "10000 steps" in note and "50 times" in note and "gradient units" in note, note
    for kw in ({"steps": long - 1}, {"steps": None}, {"steps": long, "adam": False},
               {"steps": long, "adam": False, "sgd": True}):
        settled = auto.settle("torch", "horovod", **{"adam": True, **kw})
        assert settled.local_steps == AUTO_LOCAL_STEPS, kw
    radix = parse_compression({"method": "redsync", "density": 0.005, "selection": "radix"})
    assert radix.settle("torch", "horovod", adam=True, steps=long).message.index_coding == "raw"
    sharded = auto.settle("torch", "fsdp", adam=True, steps=long)   # FSDP's own rule: every step, int8 dense layers
    assert (sharded.local_steps, sharded.message.index_coding, sharded.policy.dense_values) == (1, "golomb", "int8")
    half = parse_compression({"method": "redsync", "density": 0.005, "policy": {"dense_values": "fp16"}})
    assert half.settle("torch", "fsdp").policy.dense_values == "fp16"   # a dense format given is kept
    given = parse_compression({"method": "redsync", "density": 0.005, "local_steps": 8})
    assert given.settle("torch", "horovod", adam=True, steps=long) == given
