"""scripts/gpu_check.sh, the device script, run end to end on the CPU (``--cpu``: every step on
tiny inputs, the kernels in Triton's interpreter), so that a lent GPU's few minutes are not
spent on a broken script: every step passes, the summary has its keys, and with $OUT set the
results come back as one .tgz plus summary.json at the top of $OUT."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
STEPS = ["deps", "env", "compile", "tests", "tests_old", "selection", "passes", "stages", "overhead", "profile",
         "roofline", "summary"]


@pytest.mark.slow
def test_every_step_of_the_gpu_check_runs_on_the_cpu(tmp_path):
    results, out = tmp_path / "results", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "RESULTS": str(results), "OUT": str(out), "PY": sys.executable}
    got = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-2000:]
    steps = [line.split() for line in (results / "steps.txt").read_text().splitlines()]
    assert [s[0] for s in steps] == STEPS and all(s[1] == "rc=0" for s in steps), steps
    assert sorted(os.listdir(out)) == ["gpu_check.tgz", "summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("selection_speedup_vs_topk_eager", "selection_speedup_vs_topk_graph", "exchange_share_of_compute",
                "exchange_share_of_compute_b128", "exchange_device_ms", "launches_per_step", "host_waits_per_step"):
        assert key in summary, key
    assert summary["exchange_share_of_compute"]["resnet20"] is not None
    assert summary["launches_per_step"]["resnet20"] is not None       # counted with core/launches.py here
    with tarfile.open(out / "gpu_check.tgz") as tgz:
        names = {Path(n).name for n in tgz.getnames()}
    assert {"steps.txt", "summary.json", "overhead.json", "profile.json", "passes.json", "selection.json"} <= names
    rows = json.loads((results / "overhead.json").read_text())["rows"]
    assert {(r["method"], r["batch"]) for r in rows} >= {("redsync_mc_exact_k", 16), ("redsync_mc_exact_k", 32)}
