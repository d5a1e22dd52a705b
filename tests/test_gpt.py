"""model.name: gpt and optimizer.name: adamw: the model's shapes, causality, tied weights, names and
determinism; AdamW, no_decay and the warm-up + cosine schedule from YAML; momentum correction under
an optimizer without momentum; and the YAML runner on the pydoc text with redsync, topk and
powersgd under horovodrun (engine: horovod) and torchrun (engine: ddp)."""
import json
import math

import pytest
import torch
from launch import REPO, horovodrun, summary, torchrun

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.config import ConfigError, load_config
from redsync_hvd.engine import build_exchange
from redsync_hvd.memory import MomentumCorrectionMemory, ResidualMemory
from redsync_hvd.models import build_model
from redsync_hvd.schedule import lr_factor, total_steps
from redsync_hvd.torch.params import layers_of, resolve_names, take_momentum
from redsync_hvd.torch.training import build_optimizer

GPT_YAML = REPO / "configs" / "pydoc" / "gpt.yaml"
V, T = 50, 16


def tiny(seed=0, **options):
    torch.manual_seed(seed)
    return build_model("gpt", V, (T,), **{"d_model": 32, "n_layers": 2, "n_heads": 4, **options})


# -- the model ----------------------------------------------------------------------------------------------
def test_logits_shape_and_no_position_sees_a_later_token():
    model = tiny().eval()
    x = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))
    out = model(x)
    assert out.shape == (3, T, V)
    for t in (0, 7, T - 2):
        later = x.clone()
        later[:, t + 1:] = (later[:, t + 1:] + 1) % V   # every later token changed
        changed = model(later)
        assert torch.allclose(changed[:, :t + 1], out[:, :t + 1], rtol=0, atol=1e-6), t
        assert not torch.allclose(changed[:, t + 1:], out[:, t + 1:], atol=1e-3), t   # later positions do see them


def test_tied_output_layer_is_the_token_embedding_counted_once():
    model, d, n = tiny(), 32, 2
    names = [name for name, _ in model.named_parameters()]
    assert names.count("tok_emb.weight") == 1
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert sum(p.numel() for p in model.parameters()) == V * d + T * d + n * block + 2 * d
    # the exchange sees the parameters the optimizer holds, each once
    opt = torch.optim.AdamW(model.parameters())
    assert [n for n, _ in resolve_names(model.named_parameters(), opt.param_groups)] == names
    # no name an LSTM policy pattern ("embedding.*", "decoder.*", "lstm*") would catch by accident
    assert not [n for n in names if any(w in n for w in ("embedding", "decoder", "lstm"))]
    with torch.no_grad():
        model.tok_emb.weight.zero_()
    assert model.eval()(torch.zeros(1, T, dtype=torch.long)).abs().max() == 0   # logits = h @ tok_emb.T


def test_same_seed_same_weights_and_forward_and_gpt2_init():
    a, b, other = tiny(seed=3), tiny(seed=3), tiny(seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.tok_emb.weight, other.tok_emb.weight)
    x = torch.randint(0, V, (2, T))
    torch.manual_seed(9)
    y1 = a.train()(x)
    torch.manual_seed(9)
    assert torch.equal(y1, b.train()(x))   # dropout draws from torch's global generator
    big = tiny(d_model=256, n_layers=2)
    assert abs(big.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.001
    for proj in (big.blocks[1].attn.proj.weight, big.blocks[1].mlp.proj.weight):
        assert abs(proj.std().item() - 0.02 / math.sqrt(4)) < 0.0006   # 1/sqrt(2 * n_layers)
    assert big.blocks[0].attn.qkv.bias.abs().max() == 0 and torch.equal(big.ln_f.weight, torch.ones(256))


def test_bad_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="d_model=30 must be a multiple of n_heads=4"):
        tiny(d_model=30)
    with pytest.raises(ValueError, match="max_len=8.*seq_len"):
        tiny(max_len=8)(torch.zeros(1, T, dtype=torch.long))
    with pytest.raises(TypeError, match="unknown option.*'layers'"):
        build_model("gpt", V, (T,), layers=2)


# -- AdamW and the schedule ------------------------------------------------------------------------------
def test_adamw_from_yaml_with_no_decay_by_module_type():
    cfg = load_config(GPT_YAML, ["model.options={d_model: 32, n_layers: 2, n_heads: 4}"])
    model = tiny()
    opt = build_optimizer(cfg, model, size=2)
    assert type(opt) is torch.optim.AdamW
    decay, exempt = opt.param_groups
    assert decay["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0 and decay["betas"] == (0.9, 0.95)
    name = {id(p): n for n, p in model.named_parameters()}
    held = sorted(name[id(p)] for g in opt.param_groups for p in g["params"])
    assert held == sorted(name.values())   # every parameter, once
    assert sorted(name[id(p)] for p in decay["params"]) == sorted(
        n for n in name.values() if n.endswith(("qkv.weight", "proj.weight", "fc.weight")))
    # torch's defaults stay adam's (an existing config's optimizer is unchanged)
    adam = build_optimizer(load_config(None, ["optimizer.name=adam"]), model, size=1)
    assert adam.defaults["betas"] == (0.9, 0.999) and adam.defaults["eps"] == 1e-8 and len(adam.param_groups) == 1


@pytest.mark.parametrize("override, words", [
    ("optimizer.betas=[0.9, 1.0]", "betas"),
    ("optimizer.schedule.warmup_steps=10", "warmup_fraction.*once"),
    ("optimizer.schedule.type=step", "min_lr_factor.*cosine"),
    ("optimizer.no_decay=[weights]", "no_decay"),
])
def test_bad_optimizer_settings_name_the_field(override, words):
    with pytest.raises(ConfigError, match=words):
        load_config(GPT_YAML, [override])


def test_warmup_in_steps_then_cosine_down_to_the_floor():
    cfg = load_config(None, ["training.steps=100", "optimizer.schedule.type=cosine",
                             "optimizer.schedule.warmup_steps=10", "optimizer.schedule.min_lr_factor=0.1"])
    f = lr_factor(cfg, 7)

    def cosine(s):
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / 100))
    for s in range(10):
        assert f(s) == pytest.approx((s + 1) / 10 * cosine(s), rel=1e-12)
    assert [f(s) for s in (10, 50, 100)] == pytest.approx([cosine(10), 0.55, 0.1], rel=1e-12)
    assert all(f(s) > f(s + 1) for s in range(9, 100))
    share = load_config(GPT_YAML, ["training.steps=200"])   # warmup_fraction 0.05: 10 steps
    g = lr_factor(share, 50)
    assert g(0) == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(0))))
    assert g(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9 / 200)))
    assert g(200) == pytest.approx(0.1)


def _old_lr_factor(cfg, steps_per_epoch):
    """The schedule before warmup_steps, warmup_fraction and min_lr_factor existed."""
    sched, total = cfg.optimizer.schedule, total_steps(cfg, steps_per_epoch)

    def factor(step):
        epoch, f = step / max(1, steps_per_epoch), 1.0
        if sched.warmup_epochs and epoch < sched.warmup_epochs:
            f *= (step + 1) / (sched.warmup_epochs * steps_per_epoch)
        if sched.type == "step":
            f *= sched.gamma ** sum(epoch >= m for m in sched.milestones)
        elif sched.type == "cosine":
            f *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total))))
        return f
    return factor


def test_every_shipped_config_keeps_its_learning_rates_bit_for_bit():
    checked = 0
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        try:
            cfg = load_config(path)
        except ConfigError:
            continue   # sweeps and benchmarks: not run configs
        sched = cfg.optimizer.schedule
        if sched.warmup_steps or sched.warmup_fraction or sched.min_lr_factor:
            continue   # the GPT configs: they use the new knobs, which the old factor did not have
        for spe in (1, 7, 55):
            new, old = lr_factor(cfg, spe), _old_lr_factor(cfg, spe)
            assert all(new(s) == old(s) for s in range(0, total_steps(cfg, spe) + 2, 3)), (path, spe)
        checked += 1
    assert checked > 10, checked


# -- momentum correction under Adam -------------------------------------------------------------------------
@pytest.mark.parametrize("make, corrected", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), False),
    (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1), False),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1), True),
])
def test_redsync_momentum_correction_needs_a_momentum_else_plain_error_feedback(make, corrected):
    model = tiny()
    opt = make(model.parameters())
    named = list(model.named_parameters())
    names = {p: n for n, p in named}
    built = build_exchange({"method": "redsync", "density": 0.01}, layers_of(named), LocalCommunicator(1),
                           take_momentum=lambda: take_momentum(opt.param_groups, names))
    memory = built.exchange.memory
    assert isinstance(memory, MomentumCorrectionMemory if corrected else ResidualMemory)
    assert built.config.corrects_momentum is corrected
    notes = built.exchange.decision_record().get("notes", [])
    assert bool(notes) is not corrected and all("plain error feedback" in n for n in notes)
    # SGD's momentum and decay moved into the memory; Adam keeps its (decoupled) decay
    assert opt.param_groups[0]["weight_decay"] == (0.0 if corrected else 0.1)


# -- the YAML runner, two workers ------------------------------------------------------------------------------
METHODS = ("redsync", "topk", "powersgd", "redsync-gradient", "dct", "demo")


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    """tests/mp/gpt_methods.py: the three methods in one job per engine."""
    out = tmp_path_factory.mktemp("gpt_runs")
    script = REPO / "tests" / "mp" / "gpt_methods.py"
    horovodrun(["python", script, "horovod", out], timeout=240)
    torchrun([script, "ddp", out], timeout=240)
    return out


def _weights(folder, rank):
    return torch.load(folder / f"checkpoint-rank{rank}.pt", weights_only=False)["model"]


@pytest.mark.parametrize("engine", ["horovod", "ddp"])
@pytest.mark.parametrize("method", METHODS)
def test_gpt_adamw_trains_under_every_method_and_engine(gpt_runs, engine, method):
    folder = gpt_runs / f"{engine}-{method}"
    s = summary(folder)
    assert s["steps"] == 6 and s["workers"] == 2, s
    assert math.isfinite(s["final_loss"]) and 1 < s["final_perplexity"] < 2 * 2307, s
    assert s["compression_ratio"] > 1.5, s   # the token embedding (73,824 of 87,104 weights) compresses
    w0, w1 = _weights(folder, 0), _weights(folder, 1)
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0), "ranks ended apart"
    log = (folder / "layers.log").read_text()
    decisions = json.loads((folder / "decisions.json").read_text())
    if method in ("redsync", "topk", "dct", "demo"):   # auto: own AdamW moments, the residual holds AdamW steps
        assert log.startswith("[note] compression.feedback_units: update: each worker keeps its own Adam")
        # and the dense layers riding in the allgather (policy.dense_in_gather_bytes: auto)
        assert len([n for n in decisions["notes"] if not n.startswith("policy.dense_in_gather")]) == 1, \
            decisions["notes"]
    elif method == "redsync-gradient":   # momentum correction is on by default; AdamW has no momentum for it
        assert log.startswith("[note] compression.dgc.momentum_correction") and decisions["notes"]
    else:
        assert "[note]" not in log and "notes" not in decisions


@pytest.mark.parametrize("engine", ["horovod", "ddp"])
def test_demos_decay_and_sign_step_change_the_run_and_the_wire_does_not(gpt_runs, engine):
    """method: dct with DeMo's keys moves the weights otherwise (decay, lr * sign) on the same bytes."""
    dct, demo = summary(gpt_runs / f"{engine}-dct"), summary(gpt_runs / f"{engine}-demo")
    assert dct["wire_bytes"] == demo["wire_bytes"] and dct["final_loss"] != demo["final_loss"]


def test_fsdp_shards_the_gpt_and_keeps_adamw_with_plain_residuals(gpt_runs):
    """engine: fsdp (FSDP2, the tied embedding gathered for both of its uses), redsync under AdamW."""
    folder = gpt_runs / "fsdp-redsync"
    s = summary(folder)
    assert s["steps"] == 6 and math.isfinite(s["final_loss"]) and s["compression_ratio"] > 1.5, s
    assert (folder / "layers.log").read_text().startswith("[note] compression.dgc.momentum_correction")
    # FSDP's shards would need each worker's moments of the whole layer: gradient units, said in the notes
    notes = json.loads((folder / "decisions.json").read_text())["notes"]
    assert any("feedback_units: update" in n and "engine: fsdp" in n for n in notes), notes


@pytest.mark.parametrize("method", METHODS)
def test_the_two_engines_train_the_same_gpt_bit_for_bit(gpt_runs, method):
    """Horovod's optimizer and the DDP hook run one exchange: the same weights, loss and bytes."""
    hvd, ddp = gpt_runs / f"horovod-{method}", gpt_runs / f"ddp-{method}"
    a, b = summary(hvd), summary(ddp)
    assert (a["final_loss"], a["wire_bytes"], a["dense_bytes"]) == (b["final_loss"], b["wire_bytes"], b["dense_bytes"])
    w, v = _weights(hvd, 0), _weights(ddp, 0)
    assert all(torch.equal(w[k], v[k]) for k in w)


def test_tensorflow_trainer_steps_adamw_as_torch_does():
    """The TF trainer's optimizer (tensorflow/training.py) follows torch.optim.AdamW: decoupled decay."""
    tf = pytest.importorskip("tensorflow")
    from redsync_hvd.tensorflow.training import TorchStyleOptimizer
    gen = torch.Generator().manual_seed(0)
    w0, grads = torch.randn(5, 3, generator=gen), [torch.randn(5, 3, generator=gen) for _ in range(4)]
    var = tf.Variable(w0.numpy())
    mine = TorchStyleOptimizer([var], "adamw", weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    p = torch.nn.Parameter(w0.clone())
    ref = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for g in grads:
        mine.apply([tf.constant(g.numpy())], tf.constant(0.01))
        p.grad = g.clone()
        ref.step()
    assert torch.allclose(torch.from_numpy(var.numpy()), p.detach(), rtol=0, atol=1e-6)
    assert not torch.allclose(p.detach(), w0, atol=1e-3)


def test_tensorflow_exchange_under_keras_adam_keeps_plain_residuals_as_torch():
    """A Keras optimizer without momentum: the same fallback as torch's Adam, not a refusal."""
    tf = pytest.importorskip("tensorflow")
    from redsync_hvd.tensorflow.exchange import exchange_for
    w = tf.Variable(tf.zeros([64, 80]))
    spec = {"method": "redsync", "density": 0.01}
    adam = exchange_for([w], spec, named_variables=[("w", w)], optimizer=tf.keras.optimizers.Adam(0.01),
                        communicator=LocalCommunicator(1))
    assert isinstance(adam.exchange.memory, ResidualMemory) and adam.config.corrects_momentum is False
    assert "plain error feedback" in adam.exchange.decision_record()["notes"][0]
    sgd = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    taken = exchange_for([w], spec, named_variables=[("w", w)], optimizer=sgd, communicator=LocalCommunicator(1))
    assert isinstance(taken.exchange.memory, MomentumCorrectionMemory) and float(sgd.momentum) == 0.0
