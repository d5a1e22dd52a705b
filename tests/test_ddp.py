"""The DDP engine: the torch.distributed communicator, the communication hook, and the YAML
runner with ``engine: ddp``.

Multi-worker behaviour runs under real ``torchrun --nproc_per_node 2`` with Gloo (a few
seconds per launch); refusals run in this process on a one-rank Gloo group."""
import json

import pytest
import torch
import torch.distributed as dist
from launch import REPO, plain, run_torch_script, summary, train
from torch.nn.parallel import DistributedDataParallel as DDP

from redsync_hvd.config import load_config
from redsync_hvd.config.registry import METHODS as COMPRESSORS


def test_communicator_uneven_allgather_and_every_collective():
    out = run_torch_script("torch_dist_comm.py", nproc=2).stdout
    assert out.count("OK torch.distributed communicator") == 2, out


# one launch per script, several configs each: torchrun's start-up dominates a launch
DENSE = [
    {"method": "none"},
    {"method": "none", "check_finite": True},  # the fast path with its finite check
    # RedSync at density 1, no quantisation, no momentum correction: exactly dense
    {
        "method": "redsync",
        "local_steps": 1,
        "density": 1.0,
        "message": {"quantize": "none"},
        "dgc": {"momentum_correction": False},
        "policy": {"min_compress_numel": 0},
    },
    # momentum correction (momentum and weight decay moved out of the optimizer) without
    # masking at density 1 is plain momentum SGD
    {
        "method": "redsync",
        "local_steps": 1,
        "density": 1.0,
        "message": {"quantize": "none"},
        "dgc": {"momentum_correction": True, "momentum_masking": False},
        "policy": {"min_compress_numel": 0},
        "selection": {"method": "trimmed"},
    },
    # IWP at density 1: the leader's broadcast indices cover everything
    {"method": "iwp", "density": 1.0, "policy": {"min_compress_numel": 0}},
    # the cost model on a 1 Pbit/s, 1 us link: nothing pays, every layer dense, DDP's own reduction
    {"method": "redsync", "density": 0.01, "local_steps": 1, "dgc": {"momentum_correction": False},
     "policy": {"mode": "cost_model", "min_compress_numel": 0, "latency_s": 1e-6, "bandwidth_gbit": 1e6}},
]


def _run_all(script, specs, tag):
    out = run_torch_script(script, json.dumps(specs)).stdout
    for spec in specs:
        assert out.count(f"OK {tag}{json.dumps(spec)}") == 2, (spec, out)


def test_ddp_dense_equals_single_process():
    _run_all("ddp_dense_equals_single.py", DENSE, "")


def test_ddp_conservation_sent_plus_residual_equals_inputs():
    _run_all(
        "ddp_conservation.py",
        [
            {
                "method": "redsync",
                "local_steps": 1,
                "density": 0.05,
                "dgc": {"momentum_correction": False},
                "policy": {"min_compress_numel": 100},
            },
            # the sparse reduce-scatter: what no owner keeps goes back to its sender's residual
            {
                "method": "redsync",
                "local_steps": 1,
                "density": 0.05,
                "dgc": {"momentum_correction": False},
                "policy": {"min_compress_numel": 100},
                "aggregation": "sparse_reduce_scatter",
            },
            # the first config's dense biases ride in the allgather's capacity row (the default); here
            # they keep an allreduce of their own
            {
                "method": "redsync",
                "local_steps": 1,
                "density": 0.05,
                "dgc": {"momentum_correction": False},
                "policy": {"min_compress_numel": 100, "dense_in_gather_bytes": 0},
            },
            {"method": "signsgd"},
            {"method": "qsgd", "residual": True},
            # the worked example of docs/extending.md, known only to config/registry.py
            {"method": "threshold", "threshold": 0.05},
        ],
        "conservation ",
    )


def test_ddp_resume_is_bit_identical():
    _run_all("ddp_resume.py", [
        {"method": "redsync", "density": 0.05, "local_steps": 1,                 # residuals and velocities
         "policy": {"min_compress_numel": 100}},
        {"method": "redsync", "density": 0.05, "local_steps": 1,                  # ... by reduce-scatter
         "policy": {"min_compress_numel": 100}, "aggregation": "sparse_reduce_scatter"},
        {"method": "randomk", "density": 0.1},                               # positions drawn per step
        {"method": "qsgd", "bits": 2, "residual": True},                     # rounding seeded per step
        {"method": "redsync", "density": 0.3, "local_steps": 2,                # saved in the middle of a round
         "policy": {"min_compress_numel": 100}},
    ], "resume ")


@pytest.mark.skipif("powersgd" not in COMPRESSORS,
                    reason="needs method powersgd registered and the exchange's ctx and error_feedback='aggregate'")
def test_ddp_powersgd_full_rank_equals_dense_conserves_and_resumes():
    # rank >= min(n, m) spans every column: PowerSGD is then exact
    _run_all("ddp_dense_equals_single.py", [{"method": "powersgd", "rank": 64, "min_compression_rate": 0.01}], "")
    _run_all("ddp_conservation.py", [{"method": "powersgd", "rank": 1}], "conservation ")
    _run_all("ddp_resume.py", [{"method": "powersgd", "rank": 2, "start_iter": 1}], "resume ")   # warm Q, seed


def test_ddp_failures_raise_on_every_rank_without_hanging():
    out = run_torch_script("ddp_errors.py", timeout=90).stdout
    assert out.count("raised at step 1 (topk)") == 2 and out.count("raised at step 1 (none)") == 2, out
    assert out.count("NaN averaged as DDP does") == 2 and out.count("OK errors") == 2, out


# -- in this process, one rank ------------------------------------------------------
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _ddp():
    return DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))


@pytest.mark.parametrize("compression, words", [
    ({"method": "sbc"}, ["local steps", "horovodrun"]),
    ({"method": "dcd"}, ["decentralized", "horovodrun"]),
    ({"method": "topk", "sparse_update": True}, ["sparse_update: false"]),
    ({"method": "redsync"}, ["momentum_correction", "optimizer="]),   # on by default, no optimizer
])
def test_methods_a_hook_cannot_run_are_refused_with_the_fix(one_rank, compression, words):
    from redsync_hvd.torch import ddp as rddp
    with pytest.raises(ValueError) as err:
        rddp.register(_ddp(), compression)
    for word in words:
        assert word in str(err.value), err.value


def test_register_needs_a_ddp_model_and_an_optimizer_holding_its_parameters(one_rank):
    from redsync_hvd.torch import ddp as rddp
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        rddp.register(torch.nn.Linear(3, 3), {"method": "topk"})
    other = torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="does not hold parameters"):
        rddp.register(_ddp(), {"method": "redsync"}, optimizer=other)


def test_local_steps_need_the_optimizer_and_refuse_a_grad_scaler(one_rank):
    from redsync_hvd.torch import ddp as rddp
    spec = {"method": "redsync", "local_steps": 4, "density": 0.1}
    with pytest.raises(ValueError, match="optimizer=opt"):
        rddp.register(_ddp(), spec)
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rddp.register(model, spec, optimizer=opt)
    with pytest.raises(ValueError, match="GradScaler"):
        state.set_grad_scaler(torch.amp.GradScaler("cpu"))
    saved = state.state_dict()
    assert saved["exchange"]["delay"] == {"local": 0, "snapshot": None, "outer": {}}
    other = _ddp()
    every = rddp.register(other, {"method": "redsync", "density": 0.1, "local_steps": 1},
                          optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="local steps"):
        every.load_state_dict(saved)


def test_local_steps_auto_under_the_hook_steps_the_optimizer_given(one_rank):
    """RedSync's default under DDP: 8 local steps with int8 values under SGD and the shared variance
    under AdamW, said in the notes layers.log prints; with no optimizer to step, every step."""
    from redsync_hvd.torch import ddp as rddp
    for make, values, variance in [(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "int8", "own"),
                                   (lambda ps: torch.optim.AdamW(ps, lr=1e-3), "fp16", "shared_factored")]:
        model = _ddp()
        state = rddp.register(model, {"method": "redsync"}, optimizer=make(model.parameters()))
        config = state.config
        assert (state.rounds.steps, config.density, config.message.quantize, config.adam_variance) == \
            (8, 0.1, values, variance)
        assert any("compression.local_steps: 8 (auto)" in note for note in state.exchange.policy.notes)
    state = rddp.register(_ddp(), {"method": "redsync", "dgc": {"momentum_correction": False}})
    assert state.rounds is None and state.config.local_steps == 1
    assert any("given no optimizer" in note for note in state.exchange.policy.notes)


def test_state_from_another_method_is_refused(one_rank):
    from redsync_hvd.torch import ddp as rddp
    state = rddp.register(_ddp(), {"method": "none"})
    saved = state.state_dict()
    assert saved["method"] == "none" and saved["world_size"] == 1
    other = rddp.register(_ddp(), {"method": "topk", "density": 0.5})
    with pytest.raises(ValueError, match="same compression config"):
        other.load_state_dict(saved)


def test_momentum_correction_takes_momentum_and_decay_out_of_the_optimizer(one_rank):
    from redsync_hvd.torch import ddp as rddp
    model = _ddp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True)
    state = rddp.register(
        model, {"method": "redsync", "density": 0.5, "local_steps": 1, "policy": {"min_compress_numel": 0}},
        optimizer=opt
    )
    assert [(g["momentum"], g["weight_decay"], g["nesterov"]) for g in opt.param_groups] == [(0.0, 0.0, False)]
    assert state.exchange.memory.nesterov and set(state._decay.values()) == {1e-4}
    loss = model(torch.randn(5, 4)).square().sum()
    loss.backward()
    assert state.communication_stats()["steps"] == 1
    assert [d["compressed"] for d in state.layer_decisions()] == [True] * 4


def test_pure_low_precision_parameters_get_gradients_in_their_dtype(one_rank):
    """bf16 and fp16 parameters: DDP's buckets hold that dtype; the exchange works in fp32 and
    writes the averages back in it (the fast path reduces the buffer as DDP does)."""
    from redsync_hvd.torch import ddp as rddp
    for dtype in (torch.bfloat16, torch.float16):
        for compression in ({"method": "topk", "density": 0.5, "policy": {"min_compress_numel": 0}},
                            {"method": "none"}):
            model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(dtype))
            state = rddp.register(model, compression)
            model(torch.randn(5, 4, dtype=dtype)).float().square().sum().backward()
            grads = [p.grad for p in model.parameters()]
            assert all(g.dtype == dtype and g.abs().sum() > 0 for g in grads), (dtype, compression)
            if state.exchange is not None:
                assert all(r.dtype == torch.float32 for r in state.exchange.residuals().values())


def test_grad_scaler_skips_an_overflow_step_and_the_residuals_stay(one_rank):
    """fp16 autocast with a GradScaler through the hook: a scale that overflows fp16 gives inf
    gradients, the scaler skips the step, residuals and velocities stay; the next step trains.
    The fast path with check_finite set leaves overflows to the scaler instead of raising."""
    from redsync_hvd.torch import ddp as rddp
    for compression in ({"method": "redsync", "density": 0.5, "local_steps": 1, "policy": {"min_compress_numel": 0}},
                        {"method": "none", "check_finite": True}):
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = rddp.register(model, compression, optimizer=opt)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        state.set_grad_scaler(scaler)
        memory = state.exchange.memory if state.exchange is not None else None
        for step in range(3):
            if step > 0:   # fp16 backward overflows at 2**40; then back to a scale that fits
                scaler.update(new_scale=2.0 ** 40 if step == 1 else 2.0 ** 8)
            kept = {k: v.clone() for k, v in getattr(memory, "residual", {}).items()}
            weights = [p.detach().clone() for p in model.parameters()]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(5, 4)).float().square().sum()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            same = all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
            assert same == (step == 1), (compression["method"], step)
            if step == 1 and memory is not None:
                assert kept and all(torch.equal(kept[k], memory.residual[k]) for k in kept)
        if state.exchange is not None:
            assert state.exchange.step == 2



# -- the YAML runner with engine: ddp ------------------------------------------------
# RedSync with momentum correction (the hook takes the optimizer's momentum), in bf16 autocast;
# lr 0.2: at the digits configs' 0.05 the CNN is still at chance after 40 steps
RUN = ["training.steps=40", "training.eval_every=20", "training.precision=bf16", "optimizer.lr=0.2",
       "compression.dgc.momentum_correction=true"]


def _checkpoint(folder, rank):
    return torch.load(folder / f"checkpoint-rank{rank}.pt", weights_only=False)


def _same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """The digits CNN under torchrun --nproc_per_node 2, Gloo, checkpoints every 20 steps."""
    out = tmp_path_factory.mktemp("ddp_runs")
    train(out, "configs/digits/redsync.yaml", *RUN, "engine=ddp", "training.checkpoint_every=20", "output.name=ddp",
          "compression.local_steps=1", launcher="torchrun", timeout=240)
    return out


def test_runner_under_torchrun_trains_as_the_horovod_engine_bit_for_bit(ddp_run):
    """The same config under horovodrun (engine: horovod, bf16 as well; every step on both) ends with
    the same weights,
    residuals, velocities and figures: the engines differ only in who carries the bytes."""
    train(ddp_run, "configs/digits/redsync.yaml", *RUN, "output.name=horovod",
          "compression.local_steps=1", timeout=240)
    a, b = summary(ddp_run / "ddp"), summary(ddp_run / "horovod")
    assert a["final_accuracy"] > 0.3 and a["steps"] == 40 and a["workers"] == 2, a
    for key in ("final_accuracy", "final_loss", "wire_bytes", "dense_bytes"):
        assert a[key] == b[key], (key, a[key], b[key])
    for rank in (0, 1):
        d, h = _checkpoint(ddp_run / "ddp", rank), _checkpoint(ddp_run / "horovod", rank)
        assert d["engine"] == "ddp" and h["engine"] == "horovod"
        _same_state(d["model"], h["model"], "weights")
        mine, theirs = d["compression"]["exchange"]["memory"], h["optimizer"]["redsync"]["memory"]
        _same_state(mine["residual"], theirs["residual"], "residuals")
        _same_state(mine["velocity"], theirs["velocity"], "velocities")
        assert any(v.abs().sum() > 0 for v in mine["residual"].values())


@pytest.mark.parametrize("aggregation", ["allgather", "sparse_reduce_scatter", "sparse_reduce_scatter+coded"])
def test_local_steps_under_torchrun_train_as_the_horovod_engine_bit_for_bit(tmp_path, aggregation):
    """local_steps: 3 under the DDP hook (the hook sends nothing; register() makes optimizer.step the
    round's local step and its exchange of model deltas) and under horovodrun: 40 steps are 13
    rounds and the runner's sync before the last step; both engines end with the same weights on
    every rank, the same residuals and the same bytes, so between exchanges nothing was sent. The
    rounds' deltas meet by allgather or by the sparse reduce-scatter, whose owners return what they
    do not keep to the senders' residuals; coded, as int8 codes and Golomb-coded places per owner
    (what auto settles to under SGD), whose pieces differ in size per rank."""
    aggregation, _, coded = aggregation.partition("+")
    local = [*RUN[:-1], "compression.local_steps=3", "compression.density=0.3",
             f"compression.aggregation={aggregation}"]
    if coded:
        local += ["compression.message.quantize=int8", "compression.message.index_coding=golomb"]
    train(tmp_path, "configs/digits/redsync.yaml", *local, "engine=ddp", "output.name=ddp", launcher="torchrun",
          timeout=240)
    train(tmp_path, "configs/digits/redsync.yaml", *local, "output.name=horovod", timeout=240)
    a, b = summary(tmp_path / "ddp"), summary(tmp_path / "horovod")
    assert a["final_accuracy"] > 0.3 and a["steps"] == 40, a
    for key in ("final_accuracy", "final_loss", "wire_bytes", "dense_bytes"):
        assert a[key] == b[key], (key, a[key], b[key])
    ddp = [_checkpoint(tmp_path / "ddp", rank) for rank in (0, 1)]
    for rank in (0, 1):
        h = _checkpoint(tmp_path / "horovod", rank)
        _same_state(ddp[rank]["model"], h["model"], "weights")
        _same_state(ddp[rank]["model"], ddp[0]["model"], "one model on every rank")
        _same_state(ddp[rank]["compression"]["exchange"]["memory"]["residual"],
                    h["optimizer"]["redsync"]["memory"]["residual"], "residuals")
        assert ddp[rank]["compression"]["exchange"]["delay"]["local"] == 0   # the last step ended a round


def test_runner_resumes_under_torchrun_bit_for_bit(ddp_run):
    train(ddp_run, "configs/digits/redsync.yaml", *RUN, "engine=ddp", "output.name=resumed",
          "compression.local_steps=1", f"training.resume={ddp_run}/ddp/checkpoint-step20-rank{{rank}}.pt",
          launcher="torchrun", timeout=240)
    assert summary(ddp_run / "resumed")["wire_bytes"] == summary(ddp_run / "ddp")["wire_bytes"]
    for rank in (0, 1):
        a, b = _checkpoint(ddp_run / "ddp", rank), _checkpoint(ddp_run / "resumed", rank)
        assert a["step"] == b["step"] == 40
        _same_state(a["model"], b["model"], "weights")
        for part in ("residual", "velocity"):
            _same_state(a["compression"]["exchange"]["memory"][part], b["compression"]["exchange"]["memory"][part],
                        part)
        assert a["scheduler"] == b["scheduler"]


def test_runner_without_a_launcher_trains_one_process_in_fp16(tmp_path):
    """``python -m redsync_hvd.train`` with engine: ddp and no torchrun: a group of one process;
    fp16 autocast with its GradScaler, whose state is checkpointed."""
    train(tmp_path, "configs/digits/redsync.yaml", "engine=ddp", "training.precision=fp16", "training.steps=30",
          "optimizer.lr=0.2", "output.name=alone", launcher="python", timeout=180)
    s = summary(tmp_path / "alone")
    assert s["workers"] == 1 and s["steps"] == 30 and s["final_accuracy"] > 0.3, s
    blob = _checkpoint(tmp_path / "alone", 0)
    assert blob["scaler"]["scale"] > 0 and "compression" in blob
    assert all(torch.isfinite(v).all() for v in blob["compression"]["exchange"]["memory"]["residual"].values())


def test_a_config_started_by_the_other_launcher_stops_with_the_command(tmp_path):
    """One line from rank 0 and a non-zero exit, with no torchrun traceback after it (the ranks end
    torchrun's agent first: launchers.exit_quietly)."""
    res = train(tmp_path, "configs/digits/dense.yaml", launcher="torchrun", check=False, timeout=120)
    assert res.returncode != 0 and res.stdout.count("says engine: horovod, but this process was started by torchrun") \
        == 1 and "horovodrun -np N python -m redsync_hvd.train" in res.stdout, res.stdout[-3000:]
    assert "Traceback" not in res.stdout and "ChildFailedError" not in res.stdout, res.stdout[-3000:]
    assert res.stdout.rstrip().endswith("(--set engine=ddp) to train under torchrun"), res.stdout[-3000:]


@pytest.mark.parametrize("overrides, environ, words", [
    (["engine=ddp"], {"OMPI_COMM_WORLD_SIZE": "2"}, ["engine: ddp", "torchrun --nproc_per_node N", "engine=horovod"]),
    (["engine=ddp"], {"HOROVOD_RANK": "0"}, ["started by horovodrun"]),
    ([], {"TORCHELASTIC_RUN_ID": "x"}, ["started by torchrun", "horovodrun -np N", "engine=ddp"]),
    (["engine=ddp", "compression.method=sbc"], {}, ["local steps", "engine: horovod"]),
    (["engine=ddp", "compression.method=dcd"], {"TORCHELASTIC_RUN_ID": "x"}, ["decentralized", "engine: horovod"]),
    (["engine=ddp", "framework=tensorflow"], {}, ["framework: torch", "horovodrun", "engine: horovod"]),
    (["training.precision=bf16", "framework=tensorflow"], {}, ["framework: torch", "fp32"]),
])
def test_what_the_engine_or_launcher_cannot_run_is_named_before_any_process_group(overrides, environ, words):
    from redsync_hvd.train import engine_problem
    cfg = load_config(REPO / "configs/digits/dense.yaml", overrides)
    problem = engine_problem(cfg, "dense.yaml", environ)
    assert problem is not None, overrides
    for word in words:
        assert word in problem, problem


def test_matching_launchers_and_engines_pass(capsys):
    from redsync_hvd.train import engine_problem, main
    for overrides, environ in (([], {}), ([], {"OMPI_COMM_WORLD_SIZE": "2"}), (["engine=ddp"], {}),
                               (["engine=ddp"], {"TORCHELASTIC_RUN_ID": "x"})):
        assert engine_problem(load_config(REPO / "configs/digits/redsync.yaml", overrides), "x", environ) is None
    assert main(["--config", str(REPO / "configs/digits/sbc.yaml"), "--set", "engine=ddp"]) == 2
    assert "horovodrun" in capsys.readouterr().err


def test_the_ddp_path_needs_no_horovod_and_horovods_functions_stay():
    """``redsync_hvd.torch`` imports Horovod on first use of one of its functions: with Horovod
    unimportable the hook, the runner and its DDP adapter still import, and ``rhvd.init``
    names the DDP path; where Horovod is installed the functions are Horovod's own."""
    code = ("import sys; sys.modules['horovod'] = None\n"
            "import redsync_hvd.torch as rhvd, redsync_hvd.torch.ddp, redsync_hvd.train\n"
            "from redsync_hvd.torch.training import DDPAdapter\n"
            "try:\n    rhvd.init\nexcept ImportError as exc:\n"
            "    assert 'redsync_hvd.torch.ddp' in str(exc), exc\n    print('OK without horovod')\n")
    assert "OK without horovod" in plain(["-c", code], timeout=60).stdout
    import horovod.torch as hvd

    import redsync_hvd.torch as rhvd
    assert rhvd.init is hvd.init and rhvd.Sum is hvd.Sum and rhvd.allgather_object is hvd.allgather_object


class _CountingTorchDist:
    """The one-rank torch.distributed communicator, with a tally of the allgathers it starts."""

    def __init__(self):
        from redsync_hvd.comm.torch_dist import TorchDistCommunicator
        self.inner, self.allgathers = TorchDistCommunicator(), 0

    def allgather_async(self, tensor, name, sizes=None):
        self.allgathers += 1
        return self.inner.allgather_async(tensor, name, sizes)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_torch_distributed_gathers_a_bucket_in_one_round_with_capped_messages(one_rank):
    """On torch.distributed (which must know every rank's size before an allgather) a RedSync
    bucket travels as one capacity row with its sizes inside: one allgather a step, not a header
    round and then the data. A message is capped at 2k positions per layer (threshold reuse may
    select more); what is not sent stays in the residual: sent plus kept equals every gradient."""
    from redsync_hvd.compressors import Layer
    from redsync_hvd.engine import build_exchange
    comm = _CountingTorchDist()
    layers = [Layer("w", (20000,), 20000, 0), Layer("v", (3000,), 3000, 1)]
    ex = build_exchange({"method": "redsync", "density": 0.01, "message": {"quantize": "none"},
                         "selection": {"method": "tbs", "threshold_reuse": 50},
                         "dgc": {"momentum_correction": False}, "policy": {"min_compress_numel": 100}},
                        layers, comm).exchange
    gen = torch.Generator().manual_seed(3)
    total = {l.name: torch.zeros(l.numel, dtype=torch.float64) for l in layers}
    sent = {l.name: torch.zeros(l.numel, dtype=torch.float64) for l in layers}
    most = 0
    for step in range(12):
        scale = 1.0 if step < 2 else 4.0   # larger gradients under a reused threshold: more above it
        before = comm.allgathers
        for layer in reversed(layers):
            g = torch.randn(layer.numel, generator=gen) * scale
            total[layer.name] += g.double()
            ex.submit(layer.name, g)
        out = ex.finish().averages
        assert comm.allgathers - before == 1
        for layer in layers:
            sent[layer.name] += out[layer.name].double()
            most = max(most, int((out[layer.name] != 0).sum()) / layer.k)
    assert most == 2.0, most   # some step selected more than 2k and was capped
    for layer in layers:
        kept = ex.residuals()[layer.name].double()
        assert torch.allclose(sent[layer.name] + kept, total[layer.name], atol=1e-4), layer.name
