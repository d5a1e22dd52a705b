"""The DDP engine: the torch.distributed communicator and the communication hook.

Multi-worker behaviour runs under real ``torchrun --nproc_per_node 2`` with Gloo (a few
seconds per launch); refusals run in this process on a one-rank Gloo group."""
import json

import pytest
import torch
import torch.distributed as dist
from launch import run_torch_script
from torch.nn.parallel import DistributedDataParallel as DDP

from redsync_hvd.compressors import COMPRESSORS


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
        "density": 1.0,
        "message": {"quantize": "none"},
        "dgc": {"momentum_correction": False},
        "policy": {"min_compress_numel": 0},
    },
    # momentum correction (momentum and weight decay moved out of the optimizer) without
    # masking at density 1 is plain momentum SGD
    {
        "method": "redsync",
        "density": 1.0,
        "message": {"quantize": "none"},
        "dgc": {"momentum_correction": True, "momentum_masking": False},
        "policy": {"min_compress_numel": 0},
        "selection": {"method": "trimmed"},
    },
    # IWP at density 1: the leader's broadcast indices cover everything
    {"method": "iwp", "density": 1.0, "policy": {"min_compress_numel": 0}},
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
                "density": 0.05,
                "dgc": {"momentum_correction": False},
                "policy": {"min_compress_numel": 100},
            },
            {"method": "signsgd"},
            {"method": "qsgd", "residual": True},
        ],
        "conservation ",
    )


def test_ddp_resume_is_bit_identical():
    _run_all("ddp_resume.py", [
        {"method": "redsync", "density": 0.05, "policy": {"min_compress_numel": 100}},   # residuals and velocities
        {"method": "randomk", "density": 0.1},                               # positions drawn per step
        {"method": "qsgd", "bits": 2, "residual": True},                     # rounding seeded per step
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
        model, {"method": "redsync", "density": 0.5, "policy": {"min_compress_numel": 0}}, optimizer=opt
    )
    assert [(g["momentum"], g["weight_decay"], g["nesterov"]) for g in opt.param_groups] == [(0.0, 0.0, False)]
    assert state.exchange.memory.nesterov and set(state._decay.values()) == {1e-4}
    loss = model(torch.randn(5, 4)).square().sum()
    loss.backward()
    assert state.communication_stats()["steps"] == 1
    assert [d["compressed"] for d in state.layer_decisions()] == [True] * 4
