"""The sweep command (python -m redsync_hvd.experiments.sweep) end to end in --quick mode: one row
under horovodrun and under torchrun (the runner with engine: ddp), and plain DDP's row (real
horovodrun and torchrun), the table, the plot, a resumed invocation, and a run folder of another
job refused; the sweep files' errors; the launcher's MPI-singleton filter."""
import json
import subprocess
import sys

import pytest
from launch import BIN, REPO, plain

from redsync_hvd.experiments.sweep import SweepError, load_sweep

SWEEP = [sys.executable, "-m", "redsync_hvd.experiments.sweep"]


def test_quick_sweep_dense_under_horovod_torchrun_and_ddp_train_the_same_and_resumes(tmp_path):
    cmd = SWEEP + ["configs/sweeps/baselines.yaml", "--quick", "--parts", "digits", "--only", "dense", "dense-ddp",
                   "--launcher", "horovodrun", "torchrun", "--runs", str(tmp_path / "runs"), "--out",
                   str(tmp_path / "out"), "--timeout", "150"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("dense-hvd2-s0", "dense-torchrun2-s0", "dense-ddp-torchrun2-s0"):
        assert f"digits {name}: ok" in res.stdout, res.stdout
    out = tmp_path / "out"
    runs = {(r["row"], r["launch"]): r for r in json.loads((out / "results.json").read_text())["runs"]}
    hvd, runner_ddp, ddp = runs["dense", "hvd2"], runs["dense", "torchrun2"], runs["dense-ddp", "torchrun2"]
    # the same loop, data order and seed: dense under Horovod, under the runner's DDP engine and
    # under plain DDP train the same weights
    assert hvd["steps"] == runner_ddp["steps"] == ddp["steps"] == 8, (hvd, ddp)
    assert hvd["final_loss"] == runner_ddp["final_loss"] == ddp["final_loss"], (hvd, runner_ddp, ddp)
    assert hvd["dense_bytes"] == ddp["dense_bytes"] and 0.99 < hvd["ratio"] <= 1.0 and ddp["ratio"] == 1.0
    assert runner_ddp["sets"][-1] == "training.steps=8" and runner_ddp["launcher"] == "torchrun"
    table = (out / "table.md").read_text()
    assert "| dense fp32 (DDP) | torchrun2 |" in table and "| dense fp32 | hvd2 |" in table, table
    assert (out / "accuracy_vs_bytes_digits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sweep configs/sweeps/baselines.yaml --quick" in (out / "command.txt").read_text()
    assert json.loads((out / "machine.json").read_text())["cores"] >= 1
    assert len((out / "results.csv").read_text().splitlines()) == 4
    # resumed: finished runs are read back, nothing is launched again
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and ": ok" not in again.stdout, again.stdout
    assert (out / "table.md").read_text() == table
    # a full run pointed at the quick runs' folders stops before it launches anything
    full = [c for c in cmd if c != "--quick"]
    refused = subprocess.run(full, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "dense-hvd2-s0 holds a run of another job" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "--runs" in refused.stderr


@pytest.mark.parametrize("text, message", [
    ("rows: {a: {config: configs/digits/nothere.yaml}}", "row 'a': config configs/digits/nothere.yaml not found"),
    ("rows: {a: {config: configs/digits/dense.yaml, sets: []}}", "row 'a': expected a mapping with keys"),
    ("rows: {a: {base: b}}", "row 'a': base 'b' is not another row"),
    ("rows: {a: {config: configs/digits/dense.yaml, set: x=1}}", "row 'a': set must be a list"),
    ("rows: {a b: {config: configs/digits/dense.yaml}, a_b: {config: configs/digits/dense.yaml}}",
     "share a run folder name"),
    ("seed: [0]\nrows: {a: {config: configs/digits/dense.yaml}}", "keys from"),
    ("columns: [ratio, acc]\nrows: {a: {config: configs/digits/dense.yaml}}", "unknown columns or plots ['acc']"),
    ("rows: {a: {config: configs/digits/dense.yaml, reference: b}}", "reference ['b'] is not a row"),
])
def test_a_bad_sweep_file_is_refused_with_what_to_fix(tmp_path, text, message):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SweepError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_sweep(path)


def test_every_row_of_every_sweep_file_is_a_valid_run_config():
    """A sweep stops at its first bad row only when it reaches it: check them all here."""
    from redsync_hvd.config import load_config
    files = sorted((REPO / "configs/sweeps").glob("*.yaml"))
    assert len(files) >= 6
    for f in files:
        sweep = load_sweep(f)
        for key, row in sweep.rows.items():
            for part in sweep.parts.values():
                for quick in ([], sweep.quick + part["quick"] + row["quick"]):
                    load_config(REPO / row["config"], row["set"] + sweep.sets + part["set"] + quick)


def test_a_row_takes_its_base_rows_config_and_overrides_first():
    sweep = load_sweep(REPO / "configs/sweeps/pydoc.yaml")
    base, row = sweep.rows["redsync-compact60-fp16"], sweep.rows["redsync-fp16-70"]
    assert row["config"] == base["config"] and row["set"] == base["set"] + ["compression.density=0.007"]
    res = subprocess.run(SWEEP + ["configs/sweeps/pydoc.yaml", "--only", "redsync", "nothere"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--only: no rows ['nothere']; the rows are: dense, redsync," in res.stderr


def test_a_job_launched_under_a_process_that_initialized_mpi_runs(tmp_path):
    """A caller that imported mpi4py (a notebook, a sweep script) is an MPI singleton; the
    jobs it starts inherit its variables, which would make their mpirun exit 1 without
    output. launch() leaves them out."""
    job = f"""
import pathlib, sys
from redsync_hvd.experiments.jobs import launch
print(launch([{str(BIN / "horovodrun")!r}, "-np", "2", "-H", "localhost:2", sys.executable, "-c", "print('rank up')"],
             pathlib.Path({str(tmp_path / "job.log")!r}), 120))
"""
    caller = f"""
import subprocess, sys
from mpi4py import MPI
sys.exit(subprocess.run([sys.executable, "-c", {job!r}]).returncode)   # inherits the singleton's variables
"""
    res = plain(["-c", caller], timeout=180)
    log = (tmp_path / "job.log").read_text()
    assert res.stdout.strip().splitlines()[-1] == "ok" and log.count("<stdout>:rank up") == 2, res.stdout + log


def test_a_finished_run_that_the_code_now_resolves_differently_is_refused(tmp_path):
    """The same overrides can mean another run after a default changes or a bug is fixed (a dgc
    section that dropped the momentum correction did): such a folder is not read as the new run."""
    import yaml

    from redsync_hvd.config import load_config
    from redsync_hvd.experiments.sweep import build as build_sweep
    from redsync_hvd.experiments.sweep import conflicts, folder_of, parse_args, plan
    args = parse_args(["configs/sweeps/remedies.yaml", "--only", "lstm-follow10-nomask", "--seeds", "3"])
    [job] = plan(build_sweep(args), args)
    folder = folder_of(job, tmp_path)
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps(job.identity()))
    (folder / "summary.json").write_text("{}")
    # what the runner writes: the resolved config, with its launch's own output and progress keys
    config = load_config(REPO / job.config, [*job.sets, "training.seed=3", f"output.dir={tmp_path}",
                                             "training.progress=false"]).to_dict()
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    assert conflicts([job], tmp_path) == []
    config["compression"]["dgc"]["momentum_correction"] = False
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    [message] = conflicts([job], tmp_path)
    assert "now resolves differently (compression.dgc.momentum_correction: False then, True now)" in message, message
    # a key the run's code did not have yet is not a difference (its default is what that code did)
    config["compression"].pop("frozen_variance_after")
    config["compression"]["dgc"]["momentum_correction"] = True
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    assert conflicts([job], tmp_path) == []
    # a row that now spells out what its run had by default is the same job: its record is updated
    config["compression"]["dgc"]["momentum_correction"] = True
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    spelled = {**job.identity(), "sets": [s for s in job.sets if not s.startswith("compression.dgc.momentum_masking")]}
    (folder / "job.json").write_text(json.dumps(spelled))
    assert conflicts([job], tmp_path) == [] and json.loads((folder / "job.json").read_text()) == job.identity()
    # other overrides that ran another config stay another job's
    config["compression"]["dgc"]["momentum_masking"] = True
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    (folder / "job.json").write_text(json.dumps(spelled))
    assert "holds a run of another job" in conflicts([job], tmp_path)[0]
