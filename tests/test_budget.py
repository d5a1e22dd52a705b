"""The per-layer density budget (``compression.policy.mode: budget``; policy/budget.py,
policy/allocate.py): its arithmetic, the exchange under it in one process (bytes per step,
conservation, resume, pinning), bad values, and real 2-worker jobs (every rank's densities,
the runner's layers.log, decisions.json and a resume)."""
import itertools
import json
import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from launch import case_output, summary, train

from redsync_hvd import checkpoint
from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.compressors.base import Layer
from redsync_hvd.config.compression import parse_compression
from redsync_hvd.core.layout import k_of
from redsync_hvd.engine import build_exchange
from redsync_hvd.policy.allocate import (
    DP_UNITS,
    Cost,
    allocate_dp,
    allocate_threshold,
    candidates,
    density_of,
    descent_bought,
    descent_curve,
    fill,
    grid_size,
    layer_curve,
    magnitude_curve,
)

# big layers whose gradients differ in scale by 100x, a small one, and a dense bias
SIZES = {"big": 20000, "mid": 6000, "small": 900, "bias": 50}
SCALES = {"big": 0.01, "mid": 1.0, "small": 0.3, "bias": 1.0}
FORMATS = {
    "radix sign_mean": {"method": "redsync", "selection": "radix", "message": {"quantize": "sign_mean"}},
    "radix values": {"method": "redsync", "selection": "radix", "message": {"quantize": "none"}},
    "trimmed values": {"method": "redsync", "selection": "trimmed", "message": {"quantize": "none"}},
    "topk": {"method": "topk"},
}


def make(spec: dict, budget: dict | None = None, world: int = 2, warmup: int = 0, density: float = 0.01):
    """An exchange over SIZES' layers under a budget; ``budget["method"]`` may be ``descent``
    (dp with objective: descent)."""
    if (budget or {}).get("method") == "descent":
        budget = {**budget, "method": "dp", "objective": "descent"}
    layers = [Layer(n, (m,), m, i) for i, (n, m) in enumerate(SIZES.items())]
    full = {"density": density, "dgc": {"momentum_correction": False}, "warmup": {"steps": warmup},
            "policy": {"mode": "budget", "min_compress_numel": 100, "budget": {"every": 3, **(budget or {})}}, **spec}
    if spec["method"] == "topk":
        full.pop("dgc")
    return build_exchange(full, layers, LocalCommunicator(world), agree=False).exchange, layers


def grads(step: int, rank: int = 0) -> dict:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return {n: torch.randn(m, generator=gen) * SCALES[n] for n, m in SIZES.items()}


def step(ex, layers, g: dict) -> dict:
    for layer in reversed(layers):
        ex.submit(layer.name, g[layer.name])
    return ex.finish().averages


# -- the arithmetic ------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**7), st.data())
def test_density_of_gives_exactly_k(numel, data):
    k = data.draw(st.integers(1, numel))
    assert k_of(numel, density_of(numel, k)) == k


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([Cost(4, 4), Cost(8, 8), Cost(6, 0)])), min_size=1,
                max_size=6), st.floats(0.05, 0.9))
def test_fill_spends_the_capacity_to_the_element(layers, share):
    """Layers of different message formats: the k spend the capacity but less than one element."""
    numels, costs = [n for n, _ in layers], [c for _, c in layers]
    bounds = [(1, n) for n in numels]
    capacity = int(sum(c(1) for c in costs) + share * sum(c(n) - c(1) for c, n in zip(costs, numels)))
    ks = fill([1] * len(numels), bounds, costs, capacity)
    spent = sum(c(k) for c, k in zip(costs, ks))
    assert all(lo <= k <= hi for k, (lo, hi) in zip(ks, bounds))
    room = [c.per_element for c, k, n in zip(costs, ks, numels) if k < n]   # layers that could take more
    assert spent <= capacity and (not room or capacity - spent < min(room)), (ks, spent, capacity)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(2, 4), st.data())
def test_dp_finds_the_best_choice_that_fits(n_layers, n_cands, data):
    """Against every combination (costs on the program's own grid of units, so both see the
    same feasible set): the dynamic program's choice fits and gains as much as the best one."""
    capacity = DP_UNITS * 3
    costs = [data.draw(st.lists(st.integers(0, DP_UNITS), min_size=n_cands, max_size=n_cands)) for _ in
             range(n_layers)]
    costs = [[3 * c for c in cs] for cs in costs]
    gains = [data.draw(st.lists(st.floats(-100, 100), min_size=n_cands, max_size=n_cands)) for _ in range(n_layers)]
    fits = [combo for combo in itertools.product(range(n_cands), repeat=n_layers)
            if sum(costs[i][c] for i, c in enumerate(combo)) <= capacity]
    if not fits:
        return
    best = max(sum(gains[i][c] for i, c in enumerate(combo)) for combo in fits)
    got = allocate_dp(gains, costs, capacity)
    assert sum(costs[i][c] for i, c in enumerate(got)) <= capacity
    assert sum(gains[i][c] for i, c in enumerate(got)) >= best - 1e-9


def test_threshold_sends_what_exceeds_one_magnitude_in_every_layer():
    """Layers whose magnitudes differ in scale: one threshold gives the large-scale layer most
    of the budget, and the k-th largest magnitude of each layer is about the same."""
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen) * s for n, s in ((20000, 1.0), (20000, 0.25), (5000, 0.8))]
    cost, mean = Cost(8, 0), 0.01
    grids = [candidates(x.numel(), mean, 16.0) for x in xs]
    rows = [layer_curve(x, g, grid_size(16.0), False).double().numpy() for x, g in zip(xs, grids)]
    curves = [magnitude_curve(r, g, False) for r, g in zip(rows, grids)]
    capacity = sum(cost(k_of(x.numel(), mean)) for x in xs)
    bounds, costs = [(g[0], g[-1]) for g in grids], [cost] * 3
    ks = fill(allocate_threshold(curves, bounds, costs, capacity), bounds, costs, capacity)
    kth = [float(x.abs().sort(descending=True).values[k - 1]) for x, k in zip(xs, ks)]
    assert ks[0] > 1.5 * k_of(20000, mean) and ks[1] <= k_of(20000, mean) / 4, ks
    assert max(kth[0], kth[2]) / min(kth[0], kth[2]) < 1.15, kth   # the second is at its lower bound


def test_descent_curve_by_hand():
    """x = [3, -2, 1, 0.5], g = [0, -1, 2, 1]. Values: the top |x| are 3, -2, 1, buying 3*0,
    (-2)(-1), 1*2: 0, 2, 4. Sign-mean, + sign: 3, 1, 0.5 sent as their running mean 3, 2, 1.5
    against g 0, 2, 1 (cumulated 0, 2, 3): 0, 4, 4.5; - sign: only -2 and -0.5, each sent as
    minus the mean of (2, 0.5): 2, then 1.25, against -g 1, -1: 2, then 0."""
    x, g = torch.tensor([3.0, -2.0, 1.0, 0.5]), torch.tensor([0.0, -1.0, 2.0, 1.0])
    row = descent_curve(x, g, [1, 2, 3], 3, False).double().numpy()
    assert row[0] == pytest.approx(14.25) and list(row[1:]) == pytest.approx([0, 2, 4])
    row = descent_curve(x, g, [1, 2], 2, True).double().numpy()
    assert list(row[1:]) == pytest.approx([0, 4, 2, 0])
    assert list(descent_bought(row, [1, 2], True)) == pytest.approx([1, 2])


def test_descent_starves_a_residual_the_gradient_no_longer_touches():
    """Two layers of one size: ``mid`` had large gradients for three steps and then none, so
    its x is a large residual this step's gradient does not touch (an embedding's rare rows);
    the others have small steady gradients. Error feedback's energy sends more than uniform to
    ``mid``'s residual; descent sends ``mid`` its least, and the others more than uniform."""
    def run(method):
        ex, layers = make(FORMATS["radix values"], {"method": method, "every": 5}, world=1)
        for s in range(6):
            g = grads(s)
            g["big"] = g["big"] * 10
            if s >= 3:
                g["mid"] = torch.zeros_like(g["mid"])
            step(ex, layers, g)
        b = ex.policy.budget
        return dict(zip((l.name for l in b.shared), b.k)), dict(zip((l.name for l in b.shared), b.uniform)), b
    error, uniform, _ = run("dp")
    descent, _, b = run("descent")
    assert error["mid"] > uniform["mid"], (error, uniform)
    assert descent["mid"] == b.bounds[1][0], (descent, b.bounds)
    assert descent["big"] + descent["small"] > uniform["big"] + uniform["small"], (descent, uniform)
    assert b.history[-1]["bought"] > b.history[-1]["bought_uniform"]


@pytest.mark.parametrize("persistent, response", [(True, 1.0), (False, 0.5)])
def test_the_residual_settles_as_the_response_says(persistent, response):
    """The premise of budget.response: under top-k error feedback the settled threshold (the k-th
    largest |x|) scales as k**-1 when the gradient has a persistent part, k**-0.5 for pure noise."""
    gen = torch.Generator().manual_seed(0)
    n, mean = 2000, torch.randn(2000, generator=gen) * 0.3
    settled = []
    for k in (10, 40):
        r, kth = torch.zeros(n), []
        for t in range(2500):
            x = r + torch.randn(n, generator=gen) + (mean if persistent else 0.0)
            top = x.abs().topk(k)
            r = x.index_fill(0, top.indices, 0.0)
            if t >= 1500:
                kth.append(float(top.values[-1]))
        settled.append(sum(kth) / len(kth))
    assert math.isclose(math.log(settled[0] / settled[1]) / math.log(4), response, abs_tol=0.1), settled


# -- the exchange under a budget -----------------------------------------------------------------
@pytest.mark.parametrize("method", ["dp", "threshold", "descent"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("given_as", ["density", "bytes"])
def test_budget_holds_to_1_percent_every_step(fmt, method, given_as):
    """After the warm-up, every step's messages spend the budget less the statistics' share
    (within 1%), the statistics go out at the choosing steps (every 3) only, and each choosing
    period as a whole stays within the budget; the densities change at the choosing steps."""
    budget = {"method": method, **({"bytes_per_step": 9000} if given_as == "bytes" else {"density": 0.02})}
    ex, layers = make(FORMATS[fmt], budget, warmup=2)
    total, reserve = ex.policy.budget.total, ex.policy.budget.reserve
    seen, period = set(), []
    for s in range(10):
        step(ex, layers, grads(s))
        last = ex.stats.last
        message = last["wire_bytes"] - last.get("bytes_budget", 0)
        if s >= 2:
            assert (total - reserve) * 0.99 <= message <= total - reserve, (s, message, total, reserve)
        if s >= 4:
            period.append(last["wire_bytes"])
        assert (last.get("bytes_budget", 0) > 0) == (s in (3, 6, 9)), (s, last.get("bytes_budget"))
        seen.add(tuple(l.k for l in layers))
    assert total * 0.99 <= sum(period[:3]) / 3 <= total and total * 0.99 <= sum(period[3:]) / 3 <= total
    assert len(seen) >= 3, seen   # the warm-up, the uniform start, and at least one choice
    k = {l.name: l.k for l in layers}
    assert k["mid"] > k["big"], k   # the layer with 100x larger gradients gets more
    if given_as == "bytes":
        assert total == 9000


def test_budget_of_a_density_is_uniforms_bytes():
    """budget.density (here the method's own density) costs what uniform density sends."""
    ex, layers = make(FORMATS["radix sign_mean"], {"every": 0})
    # the dense layer, two buckets' int32 counts of non-finite layers, the messages
    assert ex.policy.budget.total == 4 * 50 + 8 + sum(4 * k_of(SIZES[n], 0.01) + 4 for n in ("big", "mid", "small"))
    step(ex, layers, grads(0))
    assert ex.stats.last["wire_bytes"] == ex.policy.budget.total


@pytest.mark.parametrize("method", ["dp", "threshold", "descent"])
def test_conservation_with_the_budget(method):
    """What was sent plus what is kept equals what came in, across choices that change k."""
    ex, layers = make(FORMATS["radix values"], {"method": method}, world=1)
    total = {n: torch.zeros(m, dtype=torch.float64) for n, m in SIZES.items()}
    sent = {n: torch.zeros(m, dtype=torch.float64) for n, m in SIZES.items()}
    ks = set()
    for s in range(8):
        g = grads(s)
        out = step(ex, layers, g)
        ks.add(tuple(l.k for l in layers))
        for n in SIZES:
            total[n] += g[n].double()
            sent[n] += out[n].double()
    assert len(ks) >= 2
    for n in ("big", "mid", "small"):
        assert torch.allclose(sent[n] + ex.residuals()[n].double(), total[n], atol=1e-5), n


def test_resume_keeps_the_densities_and_continues_identically():
    ex, layers = make(FORMATS["radix sign_mean"])
    for s in range(5):
        step(ex, layers, grads(s))
    chosen = {l.name: l.density for l in layers}
    assert ex.policy.budget.k != ex.policy.budget.uniform
    fresh, fresh_layers = make(FORMATS["radix sign_mean"])
    assert {l.name: l.density for l in fresh_layers} != chosen
    fresh.load_state_dict(ex.state_dict())
    assert fresh.policy.budget.k == ex.policy.budget.k and fresh.policy.record() == ex.policy.record()
    for s in range(5, 8):   # a choice at step 6 from the same statistics
        a, b = step(ex, layers, grads(s)), step(fresh, fresh_layers, grads(s))
        assert all(torch.equal(a[n], b[n]) for n in a)
        assert [l.k for l in layers] == [l.k for l in fresh_layers]


def test_a_pinned_record_starts_from_its_last_choice():
    ex, layers = make(FORMATS["radix sign_mean"])
    for s in range(4):
        step(ex, layers, grads(s))
    record = ex.decision_record()
    spec = {"density": 0.01, "dgc": {"momentum_correction": False}, **FORMATS["radix sign_mean"],
            "policy": {"mode": "budget", "min_compress_numel": 100, "decisions": record, "budget": {"every": 3}}}
    other = [Layer(n, (m,), m, i) for i, (n, m) in enumerate(SIZES.items())]
    pinned = build_exchange(spec, other, LocalCommunicator(2), agree=False).exchange
    assert pinned.policy.budget.k == ex.policy.budget.k
    assert pinned.policy.budget.history[0]["why"] == "pinned start"


def test_warmup_ramps_to_the_chosen_density():
    """density(layer, step) stays the one source of k: the warm-up's stages end at the budget's."""
    ex, layers = make(FORMATS["radix sign_mean"], warmup=4)
    big = layers[0]
    ramp = [ex.policy.density(big, s) for s in range(6)]
    assert ramp[0] == 0.25 and ramp[4] == ramp[5] == big.base_density < ramp[3] < ramp[0], ramp


# -- bad values ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy, match", [
    ({"budget": {"bytes_per_step": 0}}, r"bytes_per_step=0 must be a positive number"),
    ({"budget": {"bytes_per_step": -5}}, r"bytes_per_step=-5 must be a positive number"),
    ({"budget": {"density": 1.5}}, r"policy.budget.density=1.5 is outside \(0, 1\]"),
    ({"budget": {"density": 0.01, "bytes_per_step": 100}}, "either density .* or bytes_per_step, not both"),
    ({"budget": {"spread": 0.5}}, r"spread"),
    ({"budget": {"every": -1}}, r"every"),
    ({"budget": {"method": "greedy"}}, r"'dp' or 'threshold'"),
    ({"budget": {"method": "threshold", "objective": "descent"}}, r"objective=descent .* use objective: error"),
])
def test_bad_budget_values_are_named(policy, match):
    with pytest.raises(ValueError, match=match):
        parse_compression({"method": "redsync", "selection": "radix", "policy": {"mode": "budget", **policy}})


@pytest.mark.parametrize("spec, match", [
    ({"method": "redsync"}, r"selection.method=tbs sends about k .* set selection.method: radix"),
    ({"method": "redsync", "selection": "trimmed", "message": {"quantize": "sign_mean"}},
     r"sign_mean with selection.method=trimmed .* radix"),
    ({"method": "redsync", "selection": "trimmed", "message": {"quantize": "none", "index_coding": "golomb"}},
     r"index_coding=golomb"),
    ({"method": "sbc"}, r"compression.method='sbc' sends no chosen number"),
    ({"method": "powersgd"}, r"compression.method='powersgd' sends no chosen number"),
])
def test_methods_without_a_byte_count_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_compression({**spec, "policy": {"mode": "budget"}})


def test_budgets_outside_what_the_layers_can_send_are_named():
    with pytest.raises(ValueError, match=r"bytes_per_step=220 leaves 12 .* need at least 24 .* at least 232"):
        make(FORMATS["radix sign_mean"], {"bytes_per_step": 220, "every": 0})
    with pytest.raises(ValueError, match=r"bytes_per_step=1000000 is more than the compressed layers send"):
        make(FORMATS["radix sign_mean"], {"bytes_per_step": 10**6})
    with pytest.raises(ValueError, match=r"no layer to share the budget between"):
        make({**FORMATS["radix sign_mean"], "policy": {"mode": "budget", "min_compress_numel": 10**6}})


# -- real 2-worker jobs --------------------------------------------------------------------------
BUDGET_METHODS = ["dp", "threshold", "descent"]


@pytest.mark.parametrize("method", BUDGET_METHODS)
def test_every_rank_uses_the_same_densities(method):
    """horovodrun -np 2, each rank's gradients of its own scale: the chosen k are the same on
    both ranks at every step, differ from the uniform start, and every step holds the budget.
    The three methods run in one job (launch.case_output)."""
    out = case_output("budget_ranks.py", BUDGET_METHODS, BUDGET_METHODS.index(method), timeout=300)
    assert out.count(f"OK budget ranks {method}") == 2, out[-3000:]


CONFIG = "configs/digits/redsync.yaml"
RUN = ("training.steps=60", "training.checkpoint_every=30", "training.eval_every=60",
       "compression.selection.method=radix", "compression.density=0.001", "compression.policy.mode=budget",
       "compression.policy.budget.every=20", "compression.warmup.epochs=0",
       "compression.local_steps=1")   # the budget chooses per step; auto would exchange every 8


def test_runner_logs_pins_and_resumes_the_choices(tmp_path):
    """The runner's layers.log and decisions.json show each choice; both ranks' checkpoints hold
    the same k; a run resumed from step 30 chooses again at 40 as the uninterrupted one did and
    ends bit-identical."""
    train(tmp_path, CONFIG, *RUN, "output.name=ref")
    ref = tmp_path / "ref"
    log = (ref / "layers.log").read_text()
    assert all(f"[budget] step {s} (dp)" in log for s in (20, 40)), log
    record = json.loads((ref / "decisions.json").read_text())["budget"]
    assert [h["step"] for h in record["history"]] == [0, 20, 40]
    assert summary(ref)["steps"] == 60
    states = [checkpoint.load(ref, r)["optimizer"]["redsync"]["policy"]["budget"] for r in (0, 1)]
    assert states[0]["k"] == states[1]["k"] == record["history"][-1]["k"]
    mid = tmp_path / "mid"
    mid.mkdir()
    for r in (0, 1):
        (mid / f"checkpoint-rank{r}.pt").symlink_to(ref / f"checkpoint-step30-rank{r}.pt")
    train(tmp_path, CONFIG, *RUN, "output.name=again", f"training.resume={mid}")
    again = tmp_path / "again"
    for r in (0, 1):
        a, b = checkpoint.load(ref, r), checkpoint.load(again, r)
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert a["optimizer"]["redsync"]["policy"] == b["optimizer"]["redsync"]["policy"]
    assert "[budget] step 40 (dp)" in (again / "layers.log").read_text()
    assert math.isclose(summary(again)["final_accuracy"], summary(ref)["final_accuracy"])
    np.testing.assert_equal(json.loads((again / "decisions.json").read_text())["budget"]["history"],
                            record["history"])
