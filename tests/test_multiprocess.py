"""Real horovodrun jobs: correctness of the exchange across processes. A parametrized test's cases
run in one job (launch.case_output): each test still checks its own case's lines."""
import json

import pytest
from launch import case_output, run_script

DENSE_EQUALS_SINGLE = [
    {"method": "none"},
    {"method": "topk", "density": 1.0},  # density 1 with residual: exactly dense
    {"method": "topk", "density": 1.0, "residual": False},
    # RedSync at density 1, no quantisation, no momentum correction, every step: exactly dense
    {
        "method": "redsync",
        "local_steps": 1,
        "density": 1.0,
        "message": {"quantize": "none"},
        "dgc": {"momentum_correction": False},
        "policy": {"min_compress_numel": 0},
        "selection": {"method": "tbs"},
    },
    # momentum correction without masking at density 1 is plain momentum SGD (momentum is linear)
    {
        "method": "redsync",
        "local_steps": 1,
        "density": 1.0,
        "message": {"quantize": "none"},
        "dgc": {"momentum_correction": True, "momentum_masking": False},
        "policy": {"min_compress_numel": 0},
        "selection": {"method": "trimmed"},
    },
    # the same with every layer's average applied straight to the weights (sparse_update)
    {
        "method": "redsync",
        "density": 1.0,
        "message": {"quantize": "none"},
        "dgc": {"momentum_correction": True, "momentum_masking": False},
        "policy": {"min_compress_numel": 0},
        "selection": {"method": "trimmed"},
        "sparse_update": True,
    },
    # IWP at density 1: the leader's indices cover everything, allreduce of all values = dense
    {"method": "iwp", "density": 1.0, "policy": {"min_compress_numel": 0}},
]


@pytest.mark.parametrize("case", range(len(DENSE_EQUALS_SINGLE)))
def test_dense_equals_single_process(case):
    out = case_output("dense_equals_single.py", DENSE_EQUALS_SINGLE, case)
    assert out.count("OK") == 2, out


def test_dense_equals_single_process_4_workers():
    out = run_script("dense_equals_single.py", json.dumps({"method": "none"}), np=4).stdout
    assert out.count("OK") == 4, out


@pytest.mark.parametrize("np", [2, 4])
def test_uneven_allgather_with_empty_rank(np):
    out = run_script("uneven_allgather.py", np=np).stdout
    assert out.count("OK uneven allgather") == np, out


def test_config_mismatch_across_ranks_is_an_error_not_a_hang():
    out = run_script("config_mismatch.py", np=2, timeout=90).stdout
    assert out.count("OK mismatch detected") == 2, out


def test_a_dropped_optimizer_is_freed_and_its_model_trains_on_under_a_new_one():
    out = run_script("dropped_optimizer.py", "none", "redsync", np=2).stdout
    for method in ("none", "redsync"):
        assert out.count(f"OK dropped optimizer {method}") == 2, out


def test_nan_gradient_on_one_rank_fails_everywhere_and_keeps_residuals():
    out = run_script("nonfinite.py", np=2).stdout
    assert out.count("raised at step 2") == 2, out
    assert out.count("OK nonfinite handling") == 2, out


def test_mpi4py_shares_horovods_world():
    out = run_script("mpi_world.py", np=2).stdout
    assert out.count("OK mpi4py") == 2, out


EXCHANGES = [
    {
        "density": 0.01,
        "selection": {"method": "tbs"},
        "message": {"quantize": "sign_mean", "sign_rule": "alternate"},
    },
    {"density": 0.01, "selection": {"method": "tbs", "scope": "bucket"}, "message": {"quantize": "sign_mean"}},
    # exactly k per layer on the device, fixed-size messages: no header allgather
    {"density": 0.01, "selection": "radix", "message": {"quantize": "sign_mean"}},
    {
        "density": 0.02,
        "selection": {"method": "tbs", "scope": "bucket"},
        "message": {"quantize": "fp16", "index_coding": "golomb"},
    },
    {
        "density": 0.02,
        "selection": {"method": "trimmed"},
        "message": {"quantize": "fp16", "index_coding": "golomb"},
    },
    {
        "density": 0.005,
        "selection": {"method": "sampled", "threshold_reuse": 3},
        "message": {"quantize": "sign_mean", "sign_rule": "larger", "index_coding": "golomb"},
    },
]


@pytest.mark.parametrize("case", range(len(EXCHANGES)))
def test_redsync_exchange_matches_every_ranks_message(case):
    out = case_output("redsync_exchange.py", EXCHANGES, case)
    assert out.count("OK redsync exchange") == 2, out


def test_redsync_exchange_4_workers():
    # the dense layer rides in the allgather (the default): each rank sums 4 rows where the ring allreduce summed
    options = {"density": 0.01, "selection": "tbs", "policy": {"min_compress_numel": 100}}
    out = run_script("redsync_exchange.py", json.dumps(options), np=4).stdout
    assert out.count("OK redsync exchange") == 4, out


ACCUMULATIONS = [
    {"method": "none"},
    {
        "method": "redsync",
        "local_steps": 1,   # an exchange every step, after the accumulated passes
        "density": 1.0,
        "message": {"quantize": "none"},
        "dgc": {"momentum_correction": False},
        "policy": {"min_compress_numel": 0},
    },
]


@pytest.mark.parametrize("case", range(len(ACCUMULATIONS)))
def test_gradient_accumulation(case):
    out = case_output("accumulate.py", ACCUMULATIONS, case)
    assert out.count("OK accumulate") == 2, out


@pytest.mark.parametrize("np", [2, 4])
def test_iwp_shared_indices_and_rotating_leader(np):
    out = run_script("iwp_leader.py", np=np, timeout=240).stdout
    assert out.count("OK iwp") == np, out


SBC_ROUNDS = [
    {"local_steps": 1, "density": 1.0, "message": {"binarize": False}, "check_dense": True},
    {"local_steps": 1, "density": 1.0, "message": {"binarize": False, "index_coding": "raw"}, "check_dense": True},
    {"local_steps": 4, "density": 0.05, "message": {"binarize": True}},
    {"local_steps": 3, "density": 0.01, "message": {"binarize": True, "index_coding": "raw"}},
    {"local_steps": 4, "density": 1.0, "message": {"binarize": False}, "check_local": True},
    # RedSync's and top-k's local_steps: the same delayed step through their own selection and message
    {"method": "redsync", "local_steps": 3, "density": 1.0, "message": {"quantize": "none"},
     "policy": {"min_compress_numel": 0}, "check_local": True},
    {"method": "redsync", "local_steps": 4, "density": 0.05, "message": {"index_coding": "golomb"}},
    {"method": "topk", "local_steps": 2, "density": 0.1},
    # auto: 8 steps, and density is what a step sends on average: 8 x 0.125 = the whole delta
    {"method": "topk", "local_steps": "auto", "density": 0.125, "expect_steps": 8, "check_local": True},
    # a run that ends between rounds: sync_next_step() makes its last step a round (12 = 5 + 5 + 2)
    {"method": "redsync", "local_steps": 5, "density": 1.0, "message": {"quantize": "none"},
     "policy": {"min_compress_numel": 0}, "check_local": True, "sync_last": True},
    # SparseLoCo's decay: each rank's residual fades by local_decay before its next delta joins
    {"method": "topk", "local_steps": 3, "density": 0.2, "local_decay": 0.5, "policy": {"min_compress_numel": 0}},
    # DiLoCo's outer Nesterov step on each round's average delta (buffers kept across rounds)
    {"method": "redsync", "local_steps": 3, "density": 1.0, "message": {"quantize": "none"},
     "policy": {"min_compress_numel": 0}, "check_local": True, "outer_momentum": 0.5, "outer_lr": 0.7},
]


@pytest.mark.parametrize("case", range(len(SBC_ROUNDS)))
def test_sbc_rounds_keep_models_identical(case):
    out = case_output("sbc_rounds.py", SBC_ROUNDS, case)
    assert out.count("OK sbc") == 2, out


LOCAL_NONFINITE = [
    {"method": "redsync", "local_steps": 4, "density": 0.05, "policy": {"min_compress_numel": 0}, "bad_rank": 1},
    {"method": "redsync", "local_steps": "auto", "density": 0.5, "policy": {"min_compress_numel": 0}, "bad_rank": 0},
]


@pytest.mark.parametrize("case", range(len(LOCAL_NONFINITE)))
def test_a_nan_under_local_steps_fails_the_round_on_every_rank_and_rolls_back(case):
    out = case_output("local_nonfinite.py", LOCAL_NONFINITE, case)
    assert out.count("OK local nonfinite") == 2, out
