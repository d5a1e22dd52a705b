"""scripts/project_scaling.py: reference models, the "best" row, the reduce-scatter crossings, compute
from a bench CSV."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import project_scaling as ps  # noqa: E402

CSV = REPO / "docs/results/cpu-2cores-2026-11-26/costmodel-20261126-110529/results.csv"


def test_reference_models_have_their_real_shapes():
    shapes = ps.layer_shapes(["vgg_fc4096", "resnet20", "alexnet"])
    assert sum(shapes["vgg_fc4096"]) == 17_928_474      # as the bench logs it
    assert sum(shapes["resnet20"]) == 269_722
    assert 4096 * 4096 in shapes["vgg_fc4096"]
    assert sum(shapes["alexnet"]) == pytest.approx(61.1e6, rel=0.01)


def test_best_row_names_the_fastest_method_or_dense(capsys):
    models = ["alexnet", "resnet20"]
    rows = ps.project(ps.DEFAULT_COMPUTE_S, [10.0, 100.0], 25e-6, False, True, models)
    for model in models:
        for bw in (10.0, 100.0):
            for n in ps.N_VALUES:
                cell = [r for r in rows if r["model"] == model and r["bandwidth_gbit"] == bw and r["N"] == n]
                top = max(cell, key=lambda r: r["speedup"])
                assert ps.best(rows, model, bw, n) == (top["label"] if top["speedup"] > 1 + 1e-9 else "dense")
    # allgather growth: RedSync's allgather wins AlexNet at 10 Gbit/s on 2 workers, its sparse
    # reduce-scatter (flat in N) from 4 on, up to 1024
    assert ps.best(rows, "alexnet", 10.0, 2) == "redsync" and ps.best(rows, "alexnet", 10.0, 1024) == "redsync_rs"
    assert ps.faster_from(rows, "alexnet", 10.0, "redsync_rs", "redsync") == 4
    assert ps.best(rows, "resnet20", 10.0, 8) == "dense"   # 1 MB of gradient against 0.11 s of compute
    ps.main(["--models", "resnet20", "--bandwidths", "10"])
    out = capsys.readouterr().out
    assert "| resnet20 | 10 | **best** | redsync | redsync | dense |" in out
    assert "| resnet20 | 10 | never | never |" in out   # 1 MB of gradient: no reduce-scatter pays


def test_compute_from_a_bench_csv_and_a_clear_error_without_one(tmp_path):
    compute = ps.compute_from_csv(str(CSV))
    assert compute == {"vgg_fc4096": pytest.approx(0.1161), "resnet20": pytest.approx(0.114)}
    with pytest.raises(SystemExit, match="no such file"):
        ps.compute_from_csv(str(tmp_path / "missing.csv"))
    empty = tmp_path / "empty.csv"
    empty.write_text("model,method\nx,dense\n")
    with pytest.raises(SystemExit, match="no compute_alone_s"):
        ps.compute_from_csv(str(empty))
