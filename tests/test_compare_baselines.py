"""scripts/compare_baselines.py end to end in --quick mode: one Horovod row and one DDP row
(real horovodrun and torchrun), the table, the plot, and a resumed invocation."""
import json
import subprocess
import sys

from launch import BIN, REPO, plain


def test_compare_baselines_quick_dense_under_horovod_equals_ddp(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts/compare_baselines.py"), "--quick", "--parts", "digits",
           "--only", "dense", "dense-ddp", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"),
           "--timeout", "150"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "digits dense-s0: ok" in res.stdout and "digits dense-ddp-s0: ok" in res.stdout, res.stdout
    out = tmp_path / "out"
    result = json.loads((out / "results.json").read_text())
    hvd, ddp = result["runs"]["digits"]["dense"][0], result["runs"]["digits"]["dense-ddp"][0]
    # the same loop, data order and seed: dense under DDP and under Horovod train the same weights
    assert hvd["steps"] == ddp["steps"] == 8 and hvd["loss"] == ddp["loss"], (hvd, ddp)
    assert hvd["dense_bytes"] == ddp["dense_bytes"] and 0.99 < hvd["ratio"] <= 1.0 and ddp["ratio"] == 1.0
    table = (out / "table.md").read_text()
    assert "| dense fp32 (DDP) | ddp |" in table and "digits ratio" in table, table
    assert (out / "accuracy_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "compare_baselines.py --quick" in (out / "command.txt").read_text()
    assert json.loads((out / "machine.json").read_text())["cores"] >= 1
    # resumed: finished runs are read back, nothing is launched again
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and ": ok" not in again.stdout, again.stdout
    assert (out / "table.md").read_text() == table


def test_a_job_launched_under_a_process_that_initialized_mpi_runs(tmp_path):
    """A caller that imported mpi4py (a notebook, a sweep script) is an MPI singleton; the
    scripts it starts inherit its variables, which would make their jobs' mpirun exit 1 without
    output. launch() leaves them out."""
    job = f"""
import pathlib, sys
sys.path.insert(0, {str(REPO / "scripts")!r})
from compare_baselines import launch
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
