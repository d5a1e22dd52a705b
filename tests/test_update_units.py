"""Error feedback in update units (``feedback_units: update``) and the density that follows the run
(``warmup.min_sends``): what the engine builds for each optimizer, the schedule the docs give, the
resize rules for the moments, and two workers under horovodrun and torchrun against a reference."""
import copy
import math

import pytest
import torch
from launch import run_script, run_torch_script, summary, train

from redsync_hvd import checkpoint, resize
from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.compressors.base import Layer
from redsync_hvd.config.compression import parse_compression
from redsync_hvd.engine import build_exchange
from redsync_hvd.memory import AdamUnitsMemory, MomentumCorrectionMemory, ResidualMemory
from redsync_hvd.policy import LayerPolicy
from redsync_hvd.torch.params import layers_of, take_momentum
from redsync_hvd.torch.training import param_groups
from redsync_hvd.torch.update_units import of_average_step, take_moments

UPDATE = {"method": "redsync", "density": 0.01, "feedback_units": "update"}


def built_for(make, spec=UPDATE):
    model = torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Linear(80, 3))
    opt = make(model.parameters())
    named = list(model.named_parameters())
    names = {p: n for n, p in named}
    return opt, build_exchange(spec, layers_of(named), LocalCommunicator(1),
                               take_momentum=lambda: take_momentum(opt.param_groups, names),
                               take_moments=lambda: take_moments(opt, names))


@pytest.mark.parametrize("make, memory, note", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), AdamUnitsMemory, None),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1), AdamUnitsMemory, None),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True), ResidualMemory, "amsgrad or maximize"),
    (lambda ps: torch.optim.Adagrad(ps, lr=1e-3), ResidualMemory, "is not torch.optim.Adam or AdamW"),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), MomentumCorrectionMemory, None),
])
def test_the_memory_each_optimizer_gets(make, memory, note):
    """Adam and AdamW keep moments per worker; SGD keeps DGC's correction (already update units); the rest
    fall back to gradient units and say so in the run's notes."""
    opt, built = built_for(make)
    assert type(built.exchange.memory) is memory
    notes = [n for n in built.exchange.decision_record().get("notes", []) if "feedback_units" in n]
    assert len(notes) == (memory is not MomentumCorrectionMemory), notes
    assert all(note in n for n in notes) if note else all("its residual holds its own Adam steps" in n for n in notes)
    if memory is AdamUnitsMemory:
        assert built.moments.betas["0.weight"] == tuple(opt.param_groups[0]["betas"])
        coupled = not opt.param_groups[0]["decoupled_weight_decay"]
        assert ("0.weight" in built.moments.l2) is coupled   # Adam's L2 joins the gradient; AdamW's stays out
        assert opt.param_groups[0]["weight_decay"] == 0.1    # dense layers keep the optimizer's own Adam


@pytest.mark.parametrize("method", ["redsync", "topk"])
@pytest.mark.parametrize("make, memory, noted", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), AdamUnitsMemory, False),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True), ResidualMemory, True),
    (lambda ps: torch.optim.Adagrad(ps, lr=1e-3), ResidualMemory, False),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), None, False),
])
def test_auto_takes_update_units_under_adam_and_is_silent_under_other_optimizers(method, make, memory, noted):
    """``feedback_units: auto``: update units where the adapter reproduces the optimizer's Adam; gradient
    units under any other (their own units: no note), a note where an Adam step cannot be reproduced."""
    opt, built = built_for(make, {"method": method, "density": 0.01, "feedback_units": "auto"})
    sgd = {"redsync": MomentumCorrectionMemory, "topk": ResidualMemory}[method]
    assert type(built.exchange.memory) is (memory or sgd)
    notes = [n for n in built.exchange.decision_record().get("notes", []) if "feedback_units: update needs" in n]
    assert len(notes) == noted and all("amsgrad or maximize" in n for n in notes), notes


def test_a_partial_dgc_section_keeps_redsyncs_momentum_correction():
    """``dgc: {momentum_masking: false}`` on redsync leaves the correction on (it turned it off, as the
    DGC group's own default, so a screen row meant as "no masking" ran without the correction)."""
    assert parse_compression({"method": "redsync", "dgc": {"momentum_masking": False}}).corrects_momentum
    assert not parse_compression({"method": "redsync", "dgc": {"momentum_correction": False}}).corrects_momentum
    assert not parse_compression({"method": "topk", "dgc": {"momentum_masking": False}}).corrects_momentum


def test_auto_is_the_default_and_without_an_optimizer_the_note_says_how():
    assert parse_compression({"method": "redsync"}).feedback_units == "auto"
    assert parse_compression({"method": "topk"}).in_update_units is True
    assert parse_compression({"method": "topk", "feedback_units": "gradient"}).in_update_units is False
    named = list(torch.nn.Linear(64, 80).named_parameters())
    built = build_exchange(UPDATE, layers_of(named), LocalCommunicator(1), engine="ddp",
                           take_momentum=lambda: None)
    assert type(built.exchange.memory) is ResidualMemory
    assert "register(..., optimizer=)" in built.exchange.decision_record()["notes"][-1]


def test_moments_are_transactional_and_finite():
    layer = Layer("w", (6,), 6, 0, "cpu")
    mem = AdamUnitsMemory({"w": (0.9, 0.99)}, {"w": 1e-8})
    g = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -1.0])
    x = mem.compensate("w", g).x
    assert torch.allclose(x, torch.sign(g) * (g != 0), atol=1e-6)   # Adam's first step: sign(g)
    mem.rollback()
    assert mem.steps == {} and mem.sent == set() and mem.moments["exp_avg"]["w"].abs().sum() == 0
    mem.compensate("w", g)
    mem.commit()
    assert mem.steps == {"w": 1} and mem.sent == {"w"}
    mem.compensate("w", torch.full((6,), float("nan")))
    mem.keep_finite()
    mem.commit()
    state = mem.state_dict()
    assert all(torch.isfinite(t).all() for key in ("residual", "exp_avg", "exp_avg_sq") for t in state[key].values())
    other = AdamUnitsMemory({"w": (0.9, 0.99)}, {"w": 1e-8})
    other.load_state_dict(state)
    assert other.steps == {"w": 2}
    assert torch.equal(other.compensate("w", g).x, mem.compensate("w", g).x)   # the same next step
    del layer


def test_a_frozen_variance_stops_v_and_its_bias_correction_at_step_w():
    """``frozen_variance_after: 3``: steps 1-3 are Adam's; from step 4 v and (1 - b2**3) stay, m moves on,
    and the direction is torch's Adam formula with that v (checked by hand); the residual is not sent."""
    b1, b2, eps, W = 0.9, 0.99, 1e-8, 3
    mem = AdamUnitsMemory({"w": (b1, b2)}, {"w": eps}, freeze_after=W)
    torch.manual_seed(0)
    grads = [torch.randn(5) for _ in range(6)]
    m, v, r = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    for t, g in enumerate(grads, 1):
        x = mem.compensate("w", g).x
        mem.commit()
        m = b1 * m + (1 - b1) * g
        if t <= W:
            v = b2 * v + (1 - b2) * g * g
        r = r + (m / (1 - b1 ** t)) / (v.sqrt() / (1 - b2 ** min(t, W)) ** 0.5 + eps)
        assert torch.allclose(x, r, rtol=1e-5, atol=1e-6), (t, x, r)
        if t >= W:
            assert torch.allclose(mem.moments["exp_avg_sq"]["w"], v, rtol=1e-6, atol=0)
    assert parse_compression({"method": "redsync", "feedback_units": "auto", "frozen_variance_after": 100}) \
        .frozen_variance_after == 100
    with pytest.raises(ValueError, match="set feedback_units: update"):
        parse_compression({"method": "topk", "feedback_units": "gradient", "frozen_variance_after": 100})
    opt, built = built_for(lambda ps: torch.optim.AdamW(ps, lr=1e-3), {**UPDATE, "frozen_variance_after": 7})
    assert built.exchange.memory.freeze_after == 7


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1),
                                  lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01)])
def test_of_average_step_for_one_worker_is_torchs_own_and_for_two_divides_by_the_averages_variance(make):
    """``of_average_step`` with N = 1 follows torch's Adam/AdamW (to rounding: sqrt(v / bc2) against
    sqrt(v) / sqrt(bc2)); with N = 2 it steps further where the gradient's sign flips (v_hat above
    m_hat**2) and as far where the gradient never changes."""
    torch.manual_seed(0)
    own, one, two = (torch.nn.Linear(6, 4) for _ in range(3))
    one.load_state_dict(own.state_dict())
    two.load_state_dict(own.state_dict())
    opts = [make(m.parameters()) for m in (own, one, two)]
    for step in range(12):
        x = torch.randn(8, 6) * (-1) ** step
        for m, o in zip((own, one, two), opts):
            o.zero_grad()
            m(x).sum().backward()
        opts[0].step()
        of_average_step(opts[1], 1)
        of_average_step(opts[2], 2)
    for a, b in zip(own.parameters(), one.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    # the weight's gradient flips sign with x: of_average steps further; the bias's is 8 at every
    # step (d sum / d b), no noise, so v_hat = m_hat**2 and both variances agree
    assert (two.weight - own.weight).abs().sum() > 1e-2
    assert torch.allclose(two.bias, own.bias, rtol=0, atol=1e-6)


def test_adam_variance_needs_workers_own_steps_and_reaches_the_memory():
    assert parse_compression({"method": "redsync", "local_steps": 8, "adam_variance": "of_average"}).adam_variance \
        == "of_average"
    with pytest.raises(ValueError, match="feedback_units: update or local_steps above 1"):
        parse_compression({"method": "topk", "feedback_units": "gradient", "adam_variance": "of_average"})
    for variance, workers in (("own", 1), ("of_average", 3)):
        model = torch.nn.Linear(64, 80)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        names = {p: n for n, p in model.named_parameters()}
        built = build_exchange({**UPDATE, "adam_variance": variance}, layers_of(list(model.named_parameters())),
                               LocalCommunicator(3), agree=False, take_moments=lambda: take_moments(opt, names),
                               take_momentum=lambda: take_momentum(opt.param_groups, names))
        assert built.exchange.memory.workers == workers
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.Adagrad(ps)):
        with pytest.raises(ValueError, match="keeps none .*leave adam_variance out"):
            built_for(make, {**UPDATE, "adam_variance": "of_average"})
    # shared averages the variances at exchanges of local steps: refused where every step is an exchange
    with pytest.raises(ValueError, match="shared .*local_steps is 1"):
        parse_compression({"method": "redsync", "local_steps": 1, "adam_variance": "shared"})
    with pytest.raises(ValueError, match="shared .*this run exchanges every step.*of_average"):
        built_for(lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                  {**UPDATE, "local_steps": "auto", "adam_variance": "shared"})


def test_resize_sums_residuals_averages_moments_and_reset_drops_both():
    a = {"residual": {"w": torch.ones(3)}, "exp_avg": {"w": torch.full((3,), 2.0)},
         "exp_avg_sq": {"w": torch.full((3,), 4.0)}, "steps": {"w": 7}}
    b = {"residual": {"w": torch.full((3,), 2.0)}, "exp_avg": {"w": torch.zeros(3)},
         "exp_avg_sq": {"w": torch.full((3,), 2.0)}, "steps": {"w": 5}}
    merged, dropped = resize.merge([a, b], "sum", scale=0.5)
    assert torch.equal(merged["residual"]["w"], torch.full((3,), 1.5))       # summed, then scaled
    assert torch.equal(merged["exp_avg"]["w"], torch.ones(3))                # averaged, not scaled
    assert torch.equal(merged["exp_avg_sq"]["w"], torch.full((3,), 3.0)) and merged["steps"] == {"w": 7}
    gone, counted = resize.merge([a, b], "reset")
    assert "exp_avg" not in gone and counted["residual"] == 6
    mem = AdamUnitsMemory({"w": (0.9, 0.99)}, {"w": 1e-8})
    mem.load_state_dict(gone)
    assert mem.steps == {} and mem.moments["exp_avg"] == {}


# -- the density that follows the run ---------------------------------------------------------------------
def schedule(spec: dict, steps) -> list:
    cfg = parse_compression(spec)
    policy = LayerPolicy(cfg)
    layer = Layer("w", (100_000,), 100_000, 0, "cpu")
    layer.compressed, layer.base_density = True, cfg.layer_density()
    return [policy.density(layer, s) for s in steps], policy


def test_min_sends_is_max_of_density_and_c_over_t_rounded_up_a_quarter_octave():
    """d_t = max(d, c / t) at step t = step + 1, up to the next 2**(j/4): docs/redsync.md's schedule."""
    c, d = 10.0, 0.001
    steps = list(range(0, 20_000, 37))
    got, policy = schedule({"method": "redsync", "density": d, "warmup": {"min_sends": c}}, steps)
    for s, dt in zip(steps, got):
        want = min(1.0, max(d, c / (s + 1)))
        assert want <= dt <= max(d, min(1.0, want * 2 ** 0.25)) + 1e-15, (s, dt, want)
        assert dt == 1.0 or dt == d or math.log2(dt) * 4 == pytest.approx(round(math.log2(dt) * 4))
    assert got[0] == 1.0 and got[-1] == d
    keys = {policy.layout_key(s) for s in range(20_000)}   # a bounded number of layouts
    assert len(keys) <= 4 * math.log2(1 / d) + 2
    off, _ = schedule({"method": "redsync", "density": d}, steps)
    assert set(off) == {d}


def test_min_sends_and_the_exponential_warmup_take_the_larger_density():
    spec = {"method": "redsync", "density": 0.001, "warmup": {"steps": 400, "min_sends": 2}}
    got, _ = schedule(spec, [0, 50, 100, 399, 400, 4000])
    warm, _ = schedule({**spec, "warmup": {"steps": 400}}, [0, 50, 100, 399, 400, 4000])
    follow, _ = schedule({**spec, "warmup": {"min_sends": 2}}, [0, 50, 100, 399, 400, 4000])
    assert got == [max(a, b) for a, b in zip(warm, follow)]


# -- two workers ----------------------------------------------------------------------------------------------
def test_horovod_update_units_equal_the_workers_own_adamw_steps_and_resume_bit_for_bit():
    out = run_script("update_units.py", "horovod", np=2, timeout=180).stdout
    assert out.count("OK density 1 equals") == 2 and out.count("OK a resume keeps") == 2, out[-3000:]
    assert out.count("OK of_average divides") == 2, out[-3000:]


def test_ddp_hook_update_units_equal_the_workers_own_adamw_steps_and_resume_bit_for_bit():
    out = run_torch_script("update_units.py", "ddp", nproc=2, timeout=180).stdout
    assert out.count("OK density 1 equals") == 2 and out.count("OK a resume keeps") == 2, out[-3000:]
    assert out.count("OK of_average divides") == 2, out[-3000:]


TINY_GPT = ("model.options={d_model: 32, n_layers: 1, n_heads: 2, dropout: 0.0}", "data.options.seq_len=16",
            "training.batch_size=8", "training.eval_every=0", "training.steps=4",
            "compression={method: redsync, density: 0.01, feedback_units: update}")


def test_moments_follow_on_resize_sum_from_two_workers_to_one(tmp_path):
    """The pydoc GPT under AdamW with update units, 2 workers, resumed on 1 with on_resize=sum: the new
    rank holds the mean of the two ranks' moments, the most steps, and the residuals' scaled sum."""
    train(tmp_path, "configs/pydoc/gpt.yaml", *TINY_GPT, "output.name=two", np=2, timeout=240)
    train(tmp_path, "configs/pydoc/gpt.yaml", *TINY_GPT, "output.name=one", f"training.resume={tmp_path / 'two'}",
          "training.on_resize=sum", np=1, timeout=240)
    old = [checkpoint.load(tmp_path / "two", r)["optimizer"]["redsync"]["memory"] for r in (0, 1)]
    new = checkpoint.load(tmp_path / "one", 0)["optimizer"]["redsync"]["memory"]
    scale = summary(tmp_path / "one")["resumes"][-1]["resize"]["scale"]
    assert new["steps"] and set(new["steps"].values()) == {4}
    for name in new["exp_avg"]:
        assert not torch.equal(old[0]["exp_avg"][name], old[1]["exp_avg"][name])   # the workers' own moments
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new[key][name], (old[0][key][name] + old[1][key][name]) / 2), (key, name)
        assert torch.allclose(new["residual"][name], (old[0]["residual"][name] + old[1]["residual"][name]) * scale)


def test_variance_estimates_read_what_the_workers_share_from_what_each_sees():
    """experiments/variance_estimate: with independent noise on every worker, shared finds the
    average's second moment (spread above it and below mean_v: its noise, read from N = 2
    momenta, is one sample an element); with one gradient on every worker, changing in time,
    spread and mean_v find it, and shared about 1/N of the part that changes."""
    from redsync_hvd.experiments.variance_estimate import estimates
    n, b1, b2, steps, mu = 2, 0.9, 0.95, 3000, 0.5
    gen = torch.Generator().manual_seed(0)
    for case in ("noise", "in time"):
        m, v, dense = torch.zeros(n, 4096), torch.zeros(n, 4096), torch.zeros(4096)
        for t in range(steps):
            if case == "noise":
                g = mu + torch.randn(n, 4096, generator=gen)
            else:
                g = (mu + torch.randn(1, 4096, generator=gen)).expand(n, -1)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            dense.mul_(b2).add_(g.mean(0) ** 2, alpha=1 - b2)
        got = {k: float(e.mean() / dense.mean()) for k, e in estimates(m, v, b1).items()}
        truth = mu ** 2 + (1 / n if case == "noise" else 1.0)
        assert abs(float(dense.mean()) - truth) < 0.1 * truth, (case, float(dense.mean()))
        if case == "noise":
            # spread's floor (mean_v / N) lifts the elements whose one-sample noise came out large
            assert 0.85 < got["shared"] < 1.15 and got["mean_v"] > 1.4 and 1.0 < got["spread"] < got["mean_v"], got
        else:
            assert abs(got["spread"] - 1) < 0.05 and got["shared"] < 0.75 and abs(got["mean_v"] - 1) < 0.05, got


def test_local_adam_at_one_local_step_with_the_fresh_denominator_is_dense_adamw():
    """experiments/local_adam: 1 local step and dense's own v is torch's AdamW on the workers'
    average gradient (weights, to float rounding); 2 local steps then drift: the workers' weights
    differ between exchanges and agree after each."""
    from redsync_hvd.config import load_config
    from redsync_hvd.experiments.local_adam import Workers
    cfg = load_config("configs/austen/gpt-dense.yaml", ["optimizer.lr=0.01"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(param_groups(ref, cfg.optimizer.no_decay), lr=0.01, betas=cfg.optimizer.betas,
                            eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay)
    for local_steps in (1, 2):
        group = Workers(cfg, model, 2)
        gen = torch.Generator().manual_seed(1)
        for t in range(1, 7):
            grads = [{n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()} for _ in range(2)]
            group.step(grads, t, 0.01, "fresh")
            if local_steps == 1:
                for n, p in ref.named_parameters():
                    p.grad = (grads[0][n] + grads[1][n]) / 2
                opt.step()
            if t % local_steps == 0:
                group.average()
            pairs = zip(group.models[0].parameters(), group.models[1].parameters())
            apart = any(not torch.equal(a, b) for a, b in pairs)
            assert apart == (t % local_steps != 0), (local_steps, t)
        if local_steps == 1:
            for a, b in zip(group.models[0].parameters(), ref.parameters()):
                assert torch.allclose(a, b, atol=1e-6), float((a - b).abs().max())
