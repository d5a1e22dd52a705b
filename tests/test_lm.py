"""Language models: per-layer RedSync messages (values for an embedding, sign-mean elsewhere), and
the LM figures of a real 2-worker run on the pydoc text through the sweep of configs/sweeps/pydoc.yaml."""
import json
import math
import platform
import subprocess
import sys

import pytest
import torch
from launch import REPO

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.config.compression import parse_compression
from redsync_hvd.data import pydoc
from redsync_hvd.exchange import GradientExchange
from redsync_hvd.memory import MomentumCorrectionMemory, ResidualMemory
from redsync_hvd.policy import LayerPolicy

MIXED = {"method": "redsync", "density": 0.01, "message": {"quantize": "sign_mean"},
         "selection": {"method": "exact"}, "policy": {"min_compress_numel": 0, "layers": [
             {"pattern": "embedding.*", "quantize": "none"}, {"pattern": "decoder.*", "quantize": "fp16"}]}}


def mixed_exchange(momentum_correction: bool):
    comm = LocalCommunicator(2)
    comp, cfg = build_compressor({**MIXED, "dgc": {"momentum_correction": momentum_correction}}, comm)
    layers = [Layer("embedding.weight", (50, 20), 1000, 0), Layer("lstm.weight", (40, 25), 1000, 1),
              Layer("decoder.weight", (50, 20), 1000, 2)]
    memory = MomentumCorrectionMemory(0.9) if momentum_correction else ResidualMemory()
    return GradientExchange(layers, comp, comm, LayerPolicy(cfg), memory), memory


def test_per_layer_messages_values_where_asked_sign_mean_elsewhere():
    ex, memory = mixed_exchange(False)
    gen = torch.Generator().manual_seed(0)
    total = {n: torch.zeros(1000, dtype=torch.float64) for n in ex.layers}
    sent = {n: torch.zeros(1000, dtype=torch.float64) for n in ex.layers}
    for step in range(6):
        for name in ex.layers:
            g = torch.randn(1000, generator=gen) * torch.rand(1000, generator=gen) ** 3
            total[name] += g.double()
            ex.submit(name, g)
        out = ex.finish().averages
        for name in ex.layers:
            sent[name] += out[name].double()
        last = ex.communication_stats()["layers"]
    emb, lstm, dec = (out[n][out[n] != 0] for n in ("embedding.weight", "lstm.weight", "decoder.weight"))
    assert emb.unique().numel() == emb.numel() == 10                     # values
    assert lstm.unique().numel() == 1 and lstm.numel() >= 1               # one mean, one sign
    assert dec.unique().numel() == dec.numel() == 10 and torch.equal(dec, dec.half().float())   # fp16 values
    for name in ex.layers:   # whatever the message, what left plus what stayed is what came in
        assert torch.allclose(sent[name] + memory.residual[name].double(), total[name], atol=1e-4), name
    decisions = {d["name"]: d for d in ex.layer_decisions()}
    assert decisions["embedding.weight"]["quantize"] == "none" and decisions["lstm.weight"]["quantize"] == "sign_mean"
    assert last, "per-layer figures are counted"


def test_per_layer_messages_with_momentum_correction_mask_what_each_sent():
    ex, memory = mixed_exchange(True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for name in ex.layers:
            ex.submit(name, torch.randn(1000, generator=gen))
        out = ex.finish().averages
        for name in ex.layers:
            assert (memory.velocity[name][out[name] != 0] == 0).all(), name


def test_quantize_overrides_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="policy.layers.*quantize.*topk"):
        parse_compression({"method": "topk", "policy": {"layers": [{"pattern": "x", "quantize": "none"}]}})
    with pytest.raises(ValueError, match="radix.*quantize"):
        parse_compression({**MIXED, "selection": {"method": "radix"}})
    with pytest.raises(ValueError, match="scope=bucket.*quantize"):
        parse_compression({**MIXED, "selection": {"method": "tbs", "scope": "bucket"}})


def test_pydoc_runs_report_perplexity_and_the_text_they_read(tmp_path):
    """The pydoc sweep --quick: real `horovodrun -np 2` runs of configs/pydoc/dense.yaml and
    redsync.yaml; each summary.json has the test loss and perplexity and names the Python and the
    text; the table and plots are written, and a second invocation reruns nothing."""
    cmd = [sys.executable, "-m", "redsync_hvd.experiments.sweep", "configs/sweeps/pydoc.yaml", "--quick", "--only",
           "dense", "redsync", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--timeout", "240"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    logs = "".join(f"\n--- {f.name}\n" + f.read_text()[-2000:] for f in sorted((tmp_path / "runs").rglob("*.log")))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:] + logs
    for name in ("dense-hvd2-s0", "redsync-hvd2-s0"):
        s = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        assert s["steps"] == 6 and math.isfinite(s["final_loss"]) and s["final_loss"] > 0
        assert s["final_perplexity"] == pytest.approx(math.exp(s["final_loss"]))
        assert s["final_perplexity"] < s["data"]["num_classes"] * 1.5        # it has learned a little, or not diverged
        d = s["data"]
        assert d["name"] == "pydoc" and d["eval_split"] == "test" and d["python"] == platform.python_version()
        assert d["text_sha256"] == pydoc.text_digest(pydoc.topics()) and d["tokens"]["test"] > 0
        evals = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
                 if "test_perplexity" in line]
        assert [e["step"] for e in evals] == [3, 6] and evals[-1]["test_perplexity"] == pytest.approx(
            s["final_perplexity"])
    redsync = json.loads((tmp_path / "runs" / "redsync-hvd2-s0" / "summary.json").read_text())
    assert redsync["compression_ratio"] > 1.5
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| dense fp32 |" in table and "RedSync" in table and "vs dense" in table
    for png in ("perplexity_vs_bytes.png", "perplexity_vs_steps.png"):   # one part: no part in the names
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and ": ok" not in again.stdout and (tmp_path / "out" / "table.md").read_text() == table


def test_residual_lr_own_keeps_what_waited_worth_its_own_steps_update():
    """residual_lr: own. Over a decaying learning rate, sum of lr_t * sent_t plus what is still
    carried, valued at the last rate, is sum of lr_s * g_s: each gradient moves the weights by its
    own step's rate, however long it waited (with "send", the rate of the step that sends it)."""
    comm = LocalCommunicator(2)
    comp, cfg = build_compressor({"method": "redsync", "density": 0.02, "residual_lr": "own",
                                  "message": {"quantize": "sign_mean"}, "policy": {"min_compress_numel": 0},
                                  "dgc": {"momentum_correction": False}}, comm)
    memory = ResidualMemory()
    ex = GradientExchange([Layer("w", (500,), 500, 0)], comp, comm, LayerPolicy(cfg), memory)
    rates = [1.0, 0.8, 0.8, 0.5, 0.25, 0.1, 0.05]
    lr = {"now": None}
    ex.lr_of = lambda: lr["now"]
    gen = torch.Generator().manual_seed(2)
    owed = applied = torch.zeros(500, dtype=torch.float64)
    for rate in rates:
        lr["now"] = rate
        g = torch.randn(500, generator=gen)
        owed = owed + rate * g.double()
        ex.submit("w", g)
        applied = applied + rate * ex.finish().averages["w"].double()
    assert torch.allclose(applied + rates[-1] * memory.residual["w"].double(), owed, atol=1e-5)
    assert ex.lr == rates[-1] and ex.state_dict()["lr"] == rates[-1]
    dgc = MomentumCorrectionMemory(0.9)   # DGC's velocity feeds the residual: it is scaled with it
    dgc.compensate("w", torch.ones(3))
    dgc.commit()
    dgc.scale(4.0)
    assert dgc.velocity["w"].tolist() == [4.0] * 3 and dgc.residual["w"].tolist() == [4.0] * 3


def test_residual_lr_own_is_refused_where_no_learning_rate_is_passed():
    from redsync_hvd.engine import build_exchange
    layers = [Layer("w", (10,), 10, 0)]
    with pytest.raises(ValueError, match="residual_lr: own.*residual_lr: send"):
        build_exchange({"method": "redsync", "residual_lr": "own"}, layers, LocalCommunicator(2), engine="ddp")


def test_redsync_compact_yaml_is_the_pydoc_sweep_row_it_names():
    """configs/pydoc/redsync-compact.yaml and configs/sweeps/pydoc.yaml's redsync-compact60 row (redsync.yaml
    with overrides) resolve to the same run config, so the row's results are the file's."""
    from redsync_hvd.config.run import load_config
    from redsync_hvd.experiments.sweep import load_sweep

    row = load_sweep(REPO / "configs/sweeps/pydoc.yaml").rows["redsync-compact60"]
    row = load_config(REPO / row["config"], row["set"])
    compact = load_config(REPO / "configs/pydoc/redsync-compact.yaml")
    assert compact.model_dump(exclude={"output"}) == row.model_dump(exclude={"output"})   # names differ
    assert compact.compression.density == 0.006
    assert compact.compression.message.index_coding == "golomb"


def test_redsync_fp16_yaml_is_the_pydoc_sweep_row_it_names():
    """configs/pydoc/redsync-fp16.yaml and configs/sweeps/pydoc.yaml's redsync-fp16-emb30-flat row resolve to
    the same run config: fp16 values for every compressed layer, fp16 biases, 0.3% of the
    embedding and 0.94% of the other compressed layers from the first step."""
    from redsync_hvd.config.run import load_config
    from redsync_hvd.experiments.sweep import load_sweep

    row = load_sweep(REPO / "configs/sweeps/pydoc.yaml").rows["redsync-fp16-emb30-flat"]
    row = load_config(REPO / row["config"], row["set"])
    fp16 = load_config(REPO / "configs/pydoc/redsync-fp16.yaml")
    assert fp16.model_dump(exclude={"output"}) == row.model_dump(exclude={"output"})
    c = fp16.compression
    assert (c.density, c.message.quantize, c.message.index_coding, c.warmup.epochs) == (0.0094, "fp16", "golomb", 0)
    assert c.policy.dense_values == "fp16" and c.policy.min_compress_numel == 4096
    assert [(o.pattern, o.density, o.quantize) for o in c.policy.layers] == [("embedding.*", 0.003, None)]
