"""The FSDP engine: RedSync through FSDP2's reduce-scatter (redsync_hvd/torch/fsdp.py,
redsync_hvd/exchange/sharded.py) and the YAML runner with ``engine: fsdp``.

Multi-rank behaviour runs under real ``torchrun`` with Gloo, one launch per world size with
several checks each (tests/mp/fsdp_checks.py); refusals run in this process, on a one-rank
Gloo group or before any process group (``train.engine_problem``)."""
import json
import os
import signal

import pytest
import torch
import torch.distributed as dist
from launch import catches, finish, rank_pids, run_torch_script, start_torchrun, summary, train, train_args
from test_interrupted import _check_signal_stop, _last_step, _wait

from redsync_hvd import checkpoint
from redsync_hvd.config import load_config
from redsync_hvd.engine import refuse
from redsync_hvd.exchange.sharded import ShardLayout
from redsync_hvd.train import engine_problem


@pytest.mark.parametrize("nproc, checks", [(2, "equal conserve nonfinite state policy dense16 dense8"),
                                           (3, "equal-core"),
                                           (4, "equal-core conserve dense8")])
def test_fsdp_equals_its_own_reduce_scatter_at_density_1_and_conserves(nproc, checks):
    """N = 2, 3, 4: FSDP2's sharded gradients and weights equal its own reduce-scatter's at density
    1 (N = 2 every layout: all compressed, mixed groups, momentum correction with weight decay,
    bf16 and fp16 reduce dtypes, SUM; N = 3, 4: all compressed, and mixed groups with momentum
    correction and weight decay); sent + new residuals == old residuals + gradients every step;
    a NaN on one rank raises on all with the residuals kept; a restored state takes the same step;
    the cost model decides per group; policy.dense_values: fp16 halves the dense pieces' bytes, and
    int8 sends them as codes whose rounding the residuals keep."""
    out = run_torch_script("fsdp_checks.py", *checks.split(), nproc=nproc, timeout=400).stdout
    for check in checks.split():
        assert out.count(f"OK {check} of {nproc}") == nproc, out[-4000:]


def test_layout_gives_every_other_ranks_piece_its_k_and_skips_the_own_row():
    """Two parameters of 10 and 3 rows x 2 on 4 ranks: pieces of 6 and 2 elements (the last ones
    padding), k = ceil(d * real elements) per piece of a compressed parameter; rank 1's own row
    is not among the rows that go through the selection."""
    lay = ShardLayout([6, 2], [20, 6], size=4, rank=1)
    assert (lay.row, lay.numel, lay.own()) == (8, 32, slice(8, 16))
    assert [lay.real(o, 0) for o in range(4)] == [6, 6, 6, 2] and [lay.real(o, 1) for o in range(4)] == [2, 2, 2, 0]
    assert [o for o, _ in lay.rows()] == [0, 2, 3] and lay.rows()[1][1] == slice(16, 24)
    seg = lay.segments(3, [0.5, None])
    assert seg.ks == (1, 0) and seg.sizes == (6, 2)
    assert lay.segments(0, [0.5, 0.5]).ks == (3, 1)
    assert lay.segments(2, [0.5, 0.5]) is lay.segments(0, [0.5, 0.5])   # cached per k


CONFIG = "configs/digits/redsync.yaml"
COMMON = ("engine=fsdp", "compression.dgc.momentum_correction=true", "compression.residual_dtype=bf16",
          "training.steps=30", "training.eval_every=1000", "training.log_every=1", "training.checkpoint_every=0",
          "training.checkpoint_every_s=0")


def _sigterm_run(tmp_path, name: str, at: int) -> tuple:
    """One launch of the FSDP run, SIGTERM to torchrun's process group once step ``at`` is logged:
    (its output, its exit code)."""
    run = tmp_path / name
    proc = start_torchrun(train_args(tmp_path, CONFIG, *COMMON, f"output.name={name}")[1:])
    pids = rank_pids(proc, 2)
    _wait(lambda: proc.poll() is not None or all(catches(p, signal.SIGTERM) for p in pids.values()),
          "both ranks' SIGTERM handlers")
    _wait(lambda: _last_step(run) >= at or proc.poll() is not None, f"step {at}")
    assert proc.poll() is None, f"the run ended before step {at}"
    os.killpg(proc.pid, signal.SIGTERM)
    done = finish(proc, timeout=120, check=False)
    return done.stdout, done.returncode


def test_runner_resumes_after_sigterm_bit_identical_under_torchrun(tmp_path):
    """The YAML runner with engine: fsdp (configs/digits/redsync.yaml: warm-up, sign-mean; here
    with momentum correction and bf16 residuals): a SIGTERM to torchrun's process group saves
    every rank at one step; the resumed run ends with the uninterrupted run's shards, residuals,
    velocities and byte counters on every rank, bit for bit."""
    ref = train(tmp_path, CONFIG, *COMMON, "output.name=ref", launcher="torchrun", timeout=300)
    assert "done:" in ref.stdout
    text, code = _sigterm_run(tmp_path, "run", 12)
    step = _check_signal_stop(tmp_path / "run", "SIGTERM", text, code, None)
    final = train(tmp_path, CONFIG, *COMMON, "output.name=run", f"training.resume={tmp_path / 'run'}",
                  launcher="torchrun", timeout=300)
    assert f"[resume] step {step} from" in final.stdout
    for rank in (0, 1):
        a, b = checkpoint.load(tmp_path / "ref", rank), checkpoint.load(tmp_path / "run", rank)
        assert a["engine"] == b["engine"] == "fsdp" and a["step"] == b["step"] == 30
        assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k])
                                                              for k in a["model"])
        ga, gb = a["compression"]["groups"], b["compression"]["groups"]
        held = [(g, k) for g in ga for k in ga[g]]
        assert {"residual", "velocity"} <= {k for _, k in held}, held
        assert all(torch.equal(ga[g][k], gb[g][k]) for g, k in held), rank
        assert any(ga[g]["residual"].abs().sum() > 0 for g in ga if "residual" in ga[g])
        assert a["compression"]["stats"]["total"]["wire_bytes"] == b["compression"]["stats"]["total"]["wire_bytes"]
    s = summary(tmp_path / "run")
    assert s["compression_ratio"] > 3 and s["comm_detail"]["bytes_received"] > 0, s["comm_detail"]   # in the warm-up


@pytest.mark.parametrize("overrides, words", [
    (["compression.method=sbc"], ["local steps", "engine: horovod"]),
    (["compression.method=powersgd"], ["two allreduces", "engine: horovod or engine: ddp"]),
    (["compression.method=dcd"], ["decentralized", "engine: horovod"]),
    (["compression.method=iwp"], ["leader", "engine: horovod or engine: ddp"]),
    (["compression.policy.mode=budget", "compression.selection.method=radix"], ["budget", "static"]),
    (["compression.dgc.clip_norm=1.0"], ["clip_grad_norm_"]),
    (["training.precision=fp16"], ["GradScaler", "bf16"]),
])
def test_what_fsdp_cannot_carry_is_refused_before_any_process_group(overrides, words):
    cfg = load_config("configs/digits/redsync.yaml", ["engine=fsdp", *overrides])
    problem = engine_problem(cfg, "configs/digits/redsync.yaml", {"TORCHELASTIC_RUN_ID": "x"})
    assert problem and all(w in problem for w in words), problem


def test_int8_dense_values_are_fsdp_only():
    """An allreduce sums what it carries and cannot add codes of different scales: int8 for the
    layers that go dense is refused elsewhere (DDP before its process group; Horovod, PyTorch's and
    TensorFlow's, where the exchange is built), naming the settings that work."""
    cfg = load_config("configs/digits/redsync.yaml", ["engine=ddp", "compression.policy.dense_values=int8"])
    problem = engine_problem(cfg, "x.yaml", {"TORCHELASTIC_RUN_ID": "x"})
    assert problem and "dense_values: int8" in problem and "fp16 or fp32" in problem, problem
    for framework in ("torch", "tensorflow"):
        with pytest.raises(ValueError, match="dense_values: int8 .* engine: horovod .* fp16 or fp32"):
            refuse(cfg.compression, framework, "horovod")
    cfg = load_config("configs/digits/redsync.yaml", ["engine=fsdp", "compression.policy.dense_values=int8"])
    assert engine_problem(cfg, "x.yaml", {"TORCHELASTIC_RUN_ID": "x"}) is None


def test_bf16_residuals_are_fsdp_only_and_fsdp_needs_torchrun():
    cfg = load_config("configs/digits/redsync.yaml", ["engine=ddp", "compression.residual_dtype=bf16"])
    assert "residual_dtype" in engine_problem(cfg, "x.yaml", {"TORCHELASTIC_RUN_ID": "x"})
    cfg = load_config("configs/digits/redsync.yaml", ["engine=fsdp"])
    assert "torchrun" in engine_problem(cfg, "x.yaml", {"OMPI_COMM_WORLD_SIZE": "2"})
    assert engine_problem(cfg, "x.yaml", {"TORCHELASTIC_RUN_ID": "x"}) is None


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_register_needs_fully_shard_and_the_sharded_optimizer(one_rank):
    from torch.distributed.fsdp import fully_shard

    from redsync_hvd.torch import fsdp as rfsdp
    with pytest.raises(TypeError, match="fully_shard"):
        rfsdp.register(torch.nn.Linear(3, 3), {"method": "topk"})
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    before = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # built on the unsharded parameters
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    with pytest.raises(ValueError, match="after fully_shard"):
        rfsdp.register(model, {"method": "redsync", "dgc": {"momentum_correction": True}}, optimizer=before)
    with pytest.raises(ValueError, match="optimizer="):
        rfsdp.register(model, {"method": "redsync", "dgc": {"momentum_correction": True}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    state = rfsdp.register(model, {"method": "redsync", "dgc": {"momentum_correction": True},
                                   "policy": {"min_compress_numel": 0}}, optimizer=opt)
    assert all(g["momentum"] == 0.0 and g["weight_decay"] == 0.0 for g in opt.param_groups)
    assert [g.settings.momentum for g in state.groups] == [0.9, 0.9]
    with pytest.raises(ValueError, match="world size"):
        state.load_state_dict({**state.state_dict(), "world_size": 2})
    assert json.dumps(state.layer_decisions())


def test_fsdp_checkpoints_refuse_another_world_size_whatever_on_resize(tmp_path):
    for r in (0, 1):
        checkpoint.save(tmp_path, r, {"step": 5, "world_size": 2, "fingerprint": "f", "engine": "fsdp", "model": {}})
    with pytest.raises(checkpoint.CheckpointError, match="shard .* cannot resume on 1. Start 2 workers"):
        checkpoint.resume(tmp_path, 0, 1, lambda obj: [obj], on_resize="sum")


def test_cost_model_compresses_a_big_group_on_a_slow_link_and_leaves_a_small_one_dense():
    """One FSDP group's compressed reduce-scatter against FSDP's dense one (policy.mode: cost_model
    under engine: fsdp): a 4M-element layer pays on 1 Gbit/s at N = 8, a 1k-element one does not
    (its selection and the extra collective cost more than its bytes), nor anything on one rank."""
    from redsync_hvd.policy.costmodel import Network, sharded_group_time
    slow = Network.from_config(latency_s=50e-6, bandwidth_gbit=1.0)
    big = [(4_000_000, 0.01, "sign_mean"), (2048, None, "sign_mean")]
    compressed, dense = sharded_group_time(big, 8, slow)
    assert compressed < dense / 5, (compressed, dense)
    compressed, dense = sharded_group_time([(1024, 0.01, "pairs"), (32, None, "pairs")], 8, slow)
    assert compressed > dense, (compressed, dense)
    assert sharded_group_time(big, 1, slow) == (0.0, 0.0)


def test_auto_codes_positions_under_fsdp_and_the_cost_model_prices_the_coding():
    """``local_steps: auto`` under engine: fsdp is an exchange every step with Golomb-coded positions
    (raw where the config names radix or sets local_steps); the cost model prices a group's coded
    alltoall by what each owner's share takes: int8 below fp16 below raw fp16 pairs, and the
    header alone where nothing is selected."""
    from redsync_hvd.config.compression import parse_compression
    from redsync_hvd.exchange.sharded import message_format
    from redsync_hvd.policy.costmodel import Network, coded_bytes, sharded_group_time
    settled = parse_compression({"method": "redsync", "density": 0.01}).settle("torch", "fsdp")
    assert (settled.local_steps, settled.message.index_coding, settled.message.quantize) == (1, "golomb", "fp16")
    for given in ({"selection": {"method": "radix"}}, {"local_steps": 1}):
        settled = parse_compression({"method": "redsync", "density": 0.01, **given}).settle("torch", "fsdp")
        assert settled.message.index_coding == "raw", given
    assert [message_format(q, c) for q, c in (("fp16", "raw"), ("fp16", "golomb"), ("int8", "golomb"),
                                              ("sign_mean", "golomb"))] == \
        ["pairs_fp16", "golomb_pairs_fp16", "golomb_pairs_int8", "golomb"]
    slow = Network.from_config(latency_s=0.0, bandwidth_gbit=1.0)
    times = [sharded_group_time([(4_000_000, 0.01, m)], 8, slow)[0]
             for m in ("pairs_fp16", "golomb_pairs_fp16", "golomb_pairs_int8")]
    assert times[0] > times[1] > times[2], times
    # raw fp16 pairs: 6 bytes an entry and an int32 count per owner, as before the coding was priced
    n, k = 4_000_000, 40_000
    assert 8 * (4 + coded_bytes(k // 8, n // 8, "pairs_fp16")) == 6 * k + 32


def test_auto_sends_int8_values_under_sgd_and_fp16_under_adamw(one_rank):
    """``local_steps: auto`` under FSDP2 is an exchange every step; ``register`` hands ``settle`` the
    optimizer, so under torch.optim.SGD RedSync's values travel as int8 codes (settle's rule 5), and
    under AdamW as fp16 (int8 cost the GPT 2% perplexity there); layers.log's note says which."""
    from torch.distributed.fsdp import fully_shard

    from redsync_hvd.torch import fsdp as rfsdp
    got = {}
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.AdamW(ps, lr=1e-3)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = make(model.parameters())
        state = rfsdp.register(model, {"method": "redsync"}, optimizer=opt)
        notes = " ".join(state.policy.notes)
        got[type(opt).__name__] = (state.config.message.quantize, f"values as {state.config.message.quantize}" in notes)
    assert got == {"SGD": ("int8", True), "AdamW": ("fp16", True)}
