"""RedSync pieces without communication: messages, residual, schedule, policy, state."""
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.memory import MomentumCorrectionMemory, ResidualMemory
from redsync_hvd.policy import LayerPolicy
from redsync_hvd.policy.costmodel import Network


def layer(n, density, name="w"):
    l = Layer(name, (n,), n, 0, density=density)
    l.selection = None
    return l


@pytest.mark.parametrize("coding", ["raw", "golomb"])
@pytest.mark.parametrize("rule", ["alternate", "larger"])
def test_sign_mean_reconstructs_mean_times_sign_at_sent_indices(coding, rule):
    comp, _ = build_compressor(
        {
            "method": "redsync",
            "density": 0.05,
            "message": {"quantize": "sign_mean", "sign_rule": rule, "index_coding": coding},
            "selection": {"method": "exact"},
        }
    )
    x = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    for step in (0, 1):
        lay = layer(2000, 0.05)
        msg = comp.compress(x, lay, step)
        sent = msg.positions
        mean = msg.tensors[-1]
        assert mean.numel() == 1 and msg.selected >= 100
        vals = x[sent]
        assert (vals > 0).all() or (vals < 0).all(), "one sign only"
        if rule == "alternate":
            assert bool((vals > 0).all()) == (step == 0)
        assert torch.allclose(mean, vals.mean().reshape(1))
        out = torch.zeros(2000)
        comp.decompress_add(out, msg.tensors, lay)
        expect = torch.zeros(2000)
        expect[sent] = mean
        assert torch.equal(out, expect)
        by_kind = msg.nbytes()
        assert by_kind["scalars"] == 4
        if coding == "golomb":
            assert by_kind["indices"] < 2 * sent.numel()   # ~8-12 bits, not 32
        else:
            assert by_kind["indices"] == 4 * sent.numel()


@pytest.mark.parametrize("coding", ["raw", "golomb"])
def test_int8_sends_a_code_and_one_scale_and_the_residual_keeps_the_rounding(coding):
    comp, _ = build_compressor({"method": "redsync", "density": 0.05, "selection": {"method": "exact"},
                                "message": {"quantize": "int8", "index_coding": coding},
                                "dgc": {"momentum_correction": False}})
    x = torch.randn(2000, generator=torch.Generator().manual_seed(1)) * 1e-3
    x[7] = 0.5   # one outlier sets the scale
    lay = layer(2000, 0.05)
    msg = comp.compress(x, lay, 0)
    codes, scale = msg.tensors[-2], msg.tensors[-1]
    assert codes.dtype == torch.int8 and codes.numel() == 100 and scale.shape == (1,)
    assert float(scale) == pytest.approx(0.5 / 127) and int(codes.abs().max()) == 127
    out = torch.zeros(2000)
    comp.decompress_add(out, msg.tensors, lay)
    sent = msg.positions
    assert out.count_nonzero() <= sent.numel() and out[7] == 127 * scale   # the outlier arrives exact
    assert float((out[sent] - x[sent]).abs().max()) <= float(scale) / 2 * (1 + 1e-6)
    by_kind = msg.nbytes()
    assert by_kind["values"] == 100 and by_kind["scales"] == 4
    wire = comp.wire(lay)
    assert wire.kinds == msg.kinds and wire.dtypes[-2:] == (torch.int8, torch.float32) and wire.counts[-2:] == (100, 1)
    mem = ResidualMemory()
    x2 = mem.compensate("w", x).x
    mem.update(lay, x2, comp.compress(x2, lay, 0), comp)
    mem.commit()
    assert torch.equal(mem.residual["w"], x - out)   # what rounding lost waits in the residual, exactly


def test_delta_span_rounding_error_is_what_the_receivers_lose():
    """experiments/delta_span's figure decodes through the codec, as the receivers do: int8 loses at
    most half a level of the largest value, fp16 half an ulp, and a value the wire holds exactly
    loses nothing."""
    from redsync_hvd.experiments.delta_span import CODECS, rounding_error
    v = torch.linspace(1.0, 2.0, 1001)   # a span of 2: int8's smallest value has 63 levels
    assert 0 < rounding_error(CODECS["int8"], v) <= 2.0 / 254 / 1.0
    assert 0 < rounding_error(CODECS["fp16"], v) <= 2.0 ** -11
    exact = torch.tensor([1.0, -0.5, 2.0, 0.25])
    assert rounding_error(CODECS["fp16"], exact) == 0.0
    assert rounding_error(CODECS["int8"], torch.full((5,), -3.0)) == 0.0   # every value is the scale


def test_int8_is_refused_where_its_codes_cannot_travel():
    """Refused under radix (its kernels write float values); the sparse reduce-scatter and FSDP2
    code each owner's share (exchange/scatter_wire.py; exchange/sharded.py, one scale a piece), so
    neither refuses int8 or Golomb-coded positions."""
    from redsync_hvd.config.compression import parse_compression
    with pytest.raises(ValueError, match="int8"):
        parse_compression({"method": "redsync", "selection": {"method": "radix"}, "message": {"quantize": "int8"}})
    scatter = parse_compression({"method": "redsync", "aggregation": "sparse_reduce_scatter",
                                 "message": {"quantize": "int8", "index_coding": "golomb"}})
    assert (scatter.message.quantize, scatter.message.index_coding) == ("int8", "golomb")
    fsdp = parse_compression({"method": "redsync", "message": {"quantize": "int8", "index_coding": "golomb"}})
    assert fsdp.sharded_problems() == {}, fsdp.sharded_problems()


def test_larger_rule_keeps_the_side_with_larger_mean_magnitude():
    comp, _ = build_compressor(
        {
            "method": "redsync",
            "density": 0.5,
            "message": {"quantize": "sign_mean", "sign_rule": "larger"},
            "selection": {"method": "exact"},
        }
    )
    x = torch.tensor([5.0, 4.0, -1.0, -1.5, 0.1, 0.0, 0.2, -0.1])
    msg = comp.compress(x, layer(8, 0.5), 1)
    assert sorted(msg.positions.tolist()) == [0, 1]
    assert msg.tensors[-1].item() == pytest.approx(4.5)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(10, 400), steps=st.integers(1, 5), density=st.floats(0.01, 1.0),
       quantize=st.sampled_from(["none", "fp16", "int8", "sign_mean"]), coding=st.sampled_from(["raw", "golomb"]),
       selection=st.sampled_from(["exact", "trimmed", "tbs", "sampled"]), seed=st.integers(0, 999))
def test_conservation_with_every_quantiser(n, steps, density, quantize, coding, selection, seed):
    comp, _ = build_compressor(
        {
            "method": "redsync",
            "density": density,
            "message": {"quantize": quantize, "index_coding": coding},
            "selection": selection,
            "dgc": {"momentum_correction": False},
        }
    )
    mem, gen = ResidualMemory(), torch.Generator().manual_seed(seed)
    sent, total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        g = torch.randn(n, generator=gen)
        total += g.double()
        lay = layer(n, density)
        x = mem.compensate("w", g).x
        msg = comp.compress(x, lay, step)
        out = torch.zeros(n)
        comp.decompress_add(out, msg.tensors, lay)
        mem.update(lay, x, msg, comp)
        sent += out.double()
        mem.commit()
    assert torch.allclose(sent + mem.residual["w"].double(), total, atol=1e-4)


@pytest.mark.parametrize("quantize", ["fp16", "int8", "sign_mean"])
def test_the_residual_update_takes_the_positions_it_encoded_as_a_receiver_decodes_them(quantize):
    # exact top-k returns its positions unordered; Golomb coding sends them ascending with their values:
    # the memory's update (the sender's tensors know their positions: no second decode of its own
    # payload) equals a receiver's decode of the same tensors as a plain list, bit for bit
    comp, _ = build_compressor({"method": "redsync", "density": 0.05, "selection": {"method": "exact"},
                                "message": {"quantize": quantize, "index_coding": "golomb"},
                                "dgc": {"momentum_correction": False}})
    x = torch.randn(4000, generator=torch.Generator().manual_seed(3))
    lay = layer(4000, 0.05)
    msg = comp.compress(x, lay, 0)
    assert bool((msg.positions[1:] > msg.positions[:-1]).all())
    decoded = x.clone()
    comp.decompress_add(decoded, list(msg.tensors), lay, alpha=-1.0)
    updated = x.clone()
    ResidualMemory().update(lay, updated, msg, comp)
    assert torch.equal(updated, decoded) and not torch.equal(updated, x)


def test_momentum_correction_masks_sent_velocity_and_rolls_back():
    mem = MomentumCorrectionMemory(0.9, masking=True)
    v = mem.compensate("w", torch.ones(4)).x
    v[1] = 0.0
    mem.mask("w", torch.tensor([1]))
    mem.commit()
    assert mem.velocity["w"].tolist() == [1, 0, 1, 1] and mem.residual["w"].tolist() == [1, 0, 1, 1]
    v = mem.compensate("w", torch.ones(4)).x          # u = 0.9u + g, v += u
    assert v.tolist() == pytest.approx([2.9, 1.0, 2.9, 2.9])
    mem.rollback()
    assert mem.velocity["w"].tolist() == [1, 0, 1, 1] and mem.residual["w"].tolist() == [1, 0, 1, 1]
    state = mem.state_dict()
    other = MomentumCorrectionMemory(0.9)
    other.load_state_dict(state)
    assert torch.equal(other.velocity["w"], mem.velocity["w"])


def test_dgc_warmup_schedule():
    _, cfg = build_compressor({"method": "redsync", "density": 0.001, "warmup": {"epochs": 4}})
    pol = LayerPolicy(cfg)
    lay = layer(100000, 0.001)
    pol.setup([lay])
    with pytest.raises(ValueError, match="steps per epoch"):
        pol.density(lay, 0)
    pol.steps_per_epoch = 10
    got = [pol.density(lay, s) for s in (0, 9, 10, 20, 30, 40, 100)]
    # exponential decay 0.25 -> 0.001 in 4 stages: DGC's 25%, ~6.25%, ~1.56%, ~0.4%, then 0.1%
    stage = [0.25 * (0.001 / 0.25) ** (i / 4) for i in range(4)]
    assert got == pytest.approx([stage[0], stage[0], stage[1], stage[2], stage[3], 0.001, 0.001])
    assert stage[1:] == pytest.approx([0.0625, 0.015625, 0.0039], rel=0.02)


def test_layer_overrides_and_small_layers():
    _, cfg = build_compressor({"method": "redsync", "density": 0.01, "policy": {"min_compress_numel": 100, "layers": [
        {"pattern": "embedding.*", "density": 0.001},
        {"pattern": "classifier.*", "dense": True},
        {"pattern": "conv*", "selection": "trimmed"}]}})
    layers = [layer(10000, 1, "embedding.weight"), layer(10000, 1, "classifier.weight"),
              layer(10000, 1, "conv1.weight"), layer(50, 1, "conv1.bias"), layer(10000, 1, "rnn.weight")]
    pol = LayerPolicy(cfg)
    pol.setup(layers)
    got = {l.name: (l.compressed, pol.density(l, 0), l.selection) for l in layers}
    assert got == {"embedding.weight": (True, 0.001, None), "classifier.weight": (False, 1.0, None),
                   "conv1.weight": (True, 0.01, "trimmed"), "conv1.bias": (False, 1.0, "trimmed"),
                   "rnn.weight": (True, 0.01, None)}
    assert any("dense by layers" in d["why"] for d in pol.decisions)


def test_cost_model_policy_compresses_only_where_it_pays():
    _, cfg = build_compressor(
        {"method": "redsync", "density": 0.001, "policy": {"mode": "cost_model", "min_compress_numel": 0}}
    )
    sizes = [64, 4096, 1 << 20, 1 << 24]
    slow, fast = (LayerPolicy(cfg, build_compressor(cfg)[0]) for _ in range(2))
    slow.setup([layer(n, 1, f"l{n}") for n in sizes], size=8, network=Network(alpha=1e-4, bandwidth=1.25e7))
    fast.setup([layer(n, 1, f"l{n}") for n in sizes], size=8, network=Network(alpha=1e-6, bandwidth=1e14))
    assert [d["compressed"] for d in slow.decisions][-2:] == [True, True]     # big layers on a slow link
    assert not any(d["compressed"] for d in fast.decisions)                     # nothing pays on a fast link
    assert all("cost model" in d["why"] for d in slow.decisions)


def test_selection_state_round_trips_through_compressor_state():
    comp, _ = build_compressor({"method": "redsync", "density": 0.01, "selection": {"threshold_reuse": 4}})
    x = torch.randn(50000)
    comp.compress(x, layer(50000, 0.01), 0)
    state = comp.state_dict()
    other, _ = build_compressor({"method": "redsync", "density": 0.01, "selection": {"threshold_reuse": 4}})
    other.load_state_dict(state)
    assert other.state_dict() == state and state["selection"]["w"]["threshold"] is not None


def _local_exchange(compression, layers, memory, size=2):
    """The exchange over a one-process transport that stands for ``size`` ranks, with this memory."""
    from redsync_hvd.comm import LocalCommunicator
    from redsync_hvd.exchange import GradientExchange
    comm = LocalCommunicator(size)
    comp, cfg = build_compressor(compression, comm)
    return GradientExchange(layers, comp, comm, LayerPolicy(cfg), memory, fusion_bytes=cfg.fusion_bytes)


class CountingComm:
    """A LocalCommunicator that counts the collectives each step starts, by kind."""

    def __init__(self, size):
        from redsync_hvd.comm import LocalCommunicator
        self.inner, self.started = LocalCommunicator(size), []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name.startswith(("allreduce", "allgather")) and name != "allgather_object":
            def counted(*args, **kw):
                self.started.append(name.rstrip("_").replace("_async", ""))
                return attr(*args, **kw)
            return counted
        return attr


@pytest.mark.parametrize("values", ["fp32", "fp16"])
def test_dense_layers_ride_in_the_allgather_where_their_bytes_fit(values):
    """policy.dense_in_gather_bytes: the dense layers' flat buffer, with its non-finite count and the
    caller's carry slots, travels inside the compressed layers' allgather: one collective a step
    instead of two, the same averages, carried sums and bytes bit for bit, and a NaN in a dense layer
    still fails the step. Over the cap, or at 0, the dense layers keep their allreduce."""
    from redsync_hvd.exchange import GradientExchange, NonFiniteGradientError
    gen = torch.Generator().manual_seed(4)
    spec = [("b0", 10), ("w1", 5000), ("b1", 40), ("w2", 3000)]
    grads = [{n: torch.randn(m, generator=gen) for n, m in spec} for _ in range(3)]

    def run(cap, bad=None):
        comm = CountingComm(2)
        comp, cfg = build_compressor({"method": "redsync", "density": 0.01, "policy": {
            "min_compress_numel": 100, "dense_values": values, "dense_in_gather_bytes": cap}}, comm)
        ex = GradientExchange([Layer(n, (m,), m, i) for i, (n, m) in enumerate(spec)], comp, comm,
                              LayerPolicy(cfg), ResidualMemory(), fusion_bytes=cfg.fusion_bytes)
        ex.carry = lambda: [1.0, 0.5]
        got = []
        for g in grads:
            comm.started.clear()
            for name, _ in reversed(spec):
                ex.submit(name, g[name].clone() if name != bad else torch.full_like(g[name], float("nan")))
            result = ex.finish()
            got.append(({k: v.clone() for k, v in result.averages.items()}, result.carried, list(comm.started),
                        ex.stats.last["wire_bytes"]))
        return ex, got

    fits = (4 if values == "fp32" else 2) * 50   # b0 and b1: 50 elements
    _, apart = run(0)
    ex, riding = run(fits)
    assert [b.kind for b in ex.buckets if getattr(b, "ride", None) is not None] == ["reduce"]
    for (a, carried_a, rounds_a, bytes_a), (b, carried_b, rounds_b, bytes_b) in zip(apart, riding):
        # tbs: a header allgather and the payload's, then the dense allreduce, which riding drops
        assert rounds_a == ["allgather", "allgather", "allreduce"] and rounds_b == ["allgather", "allgather"]
        assert carried_a == carried_b == [2.0, 1.0]
        assert bytes_a == bytes_b   # the riders' sizes are known to all: no header entry for them
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    over, _ = run(fits - 1)
    assert all(b.ride is None for b in over.buckets if b.kind == "reduce")
    with pytest.raises(NonFiniteGradientError, match="non-finite"):
        run(fits, bad="b1")


def test_dense_in_gather_auto_rides_the_bytes_one_rounds_latency_buys():
    """The default, ``dense_in_gather_bytes: auto``: the cap is alpha x B of the network the policy
    planned for (31,250 bytes at the cost model's 25 us and 10 Gbit/s where nothing was measured).
    Biases ride; a dense layer whose bytes pass the cap keeps its allreduce; a slower-latency
    network the cost model measured raises the cap; the run's layers.log says when they ride."""
    from redsync_hvd.comm import LocalCommunicator
    from redsync_hvd.exchange import GradientExchange

    def built(dense_numel, network=None):
        spec = [("b0", 10), ("w1", 50_000), ("d1", dense_numel)]
        comp, cfg = build_compressor({"method": "redsync", "density": 0.01,
                                      "policy": {"layers": [{"pattern": "d1", "dense": True}]}}, LocalCommunicator(4))
        assert cfg.policy.dense_in_gather_bytes == "auto"
        policy = LayerPolicy(cfg)
        ex = GradientExchange([Layer(n, (m,), m, i) for i, (n, m) in enumerate(spec)], comp, LocalCommunicator(4),
                              policy, ResidualMemory(), fusion_bytes=cfg.fusion_bytes, network=network)
        return [b.ride is not None for b in ex.buckets if b.kind == "reduce"], policy.notes

    fits = 31_250 // 4 - 10   # d1 and b0 together at the cap, in fp32
    assert built(fits) == ([True], [f"policy.dense_in_gather_bytes: the dense layers' {4 * (fits + 10)} bytes "
                                    "ride in the compressed layers' allgather (at most 31250): one collective "
                                    "round a step fewer"])
    assert built(fits + 1) == ([False], [])
    slow = Network.from_config(latency_s=250e-6, bandwidth_gbit=10.0)   # ten times the latency: ten times the cap
    assert built(312_500 // 4 - 10, slow)[0] == [True] and built(312_500 // 4 - 9, slow)[0] == [False]


def test_momentum_correction_sends_dense_layers_momentum_not_zeros():
    """Regression: a dense layer's message aliased the memory buffer that the residual
    update then zeroed, so with momentum correction small layers sent zeros."""
    layers = [Layer("bias", (10,), 10, 0), Layer("w", (5000,), 5000, 1)]
    ex = _local_exchange(
        {
            "method": "redsync",
            "density": 0.01,
            "dgc": {"momentum_correction": True},
            "policy": {"min_compress_numel": 100},
        },
        layers,
        MomentumCorrectionMemory(0.9),
    )
    u = torch.zeros(10)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        g = torch.randn(10, generator=gen)
        ex.submit("bias", g.clone())
        ex.submit("w", torch.randn(5000, generator=gen))
        out = ex.finish().averages
        u = 0.9 * u + g                       # momentum SGD on the averaged gradient
        assert torch.allclose(out["bias"], u, atol=1e-6), (out["bias"], u)
        assert torch.allclose(ex.memory.velocity["bias"], u, atol=1e-6)
        assert "bias" not in ex.memory.residual     # a dense layer keeps no residual buffer


def test_momentum_correction_on_dense_layers_equals_the_optimizers_momentum():
    """Dense layers get their momentum after averaging, batched: the result must be torch's own
    momentum SGD (and Nesterov) on the averaged gradient, several momentum values at once, and
    a failed step must leave the velocity as it was."""
    from redsync_hvd.exchange import NonFiniteGradientError
    for nesterov in (False, True):
        layers = [Layer("a", (7,), 7, 0), Layer("b", (3, 4), 12, 1), Layer("c", (5,), 5, 2)]
        memory = MomentumCorrectionMemory({"a": 0.9, "b": 0.5, "c": 0.0}, nesterov=nesterov)
        ex = _local_exchange(
            {
                "method": "redsync",
                "density": 0.01,
                "dgc": {"momentum_correction": True},
                "policy": {"min_compress_numel": 100},
            },
            layers,
            memory,
        )
        params = {l.name: torch.zeros(l.shape, requires_grad=True) for l in layers}
        ref = {n: torch.optim.SGD([p], lr=1.0, momentum=m, nesterov=nesterov and m > 0)
               for (n, p), m in zip(params.items(), (0.9, 0.5, 0.0))}
        gen = torch.Generator().manual_seed(1)
        for step in range(5):
            grads = {l.name: torch.randn(l.shape, generator=gen) for l in layers}
            if step == 3:                                   # a NaN step: nothing may change
                before = {k: v.clone() for k, v in memory.velocity.items()}
                for n, g in grads.items():
                    ex.submit(n, g.clone().fill_(float("nan")) if n == "b" else g.clone())
                with pytest.raises(NonFiniteGradientError):
                    ex.finish()
                assert all(torch.equal(before[k], memory.velocity[k]) for k in before)
                continue
            for n, g in grads.items():
                ex.submit(n, g.clone())
            out = ex.finish().averages
            for n, p in params.items():
                p.grad = grads[n].clone()
                before_p = p.detach().clone()
                ref[n].step()
                applied = before_p - p.detach()             # lr 1: the update is the direction
                assert torch.allclose(out[n].view(p.shape), applied, atol=1e-6), (nesterov, step, n)


def test_nonfinite_in_a_compressed_layer_is_caught_by_selection_and_rolls_back():
    from redsync_hvd.exchange import NonFiniteGradientError
    layers = [Layer("w", (5000,), 5000, 0)]
    ex = _local_exchange({"method": "redsync", "density": 0.01, "policy": {"min_compress_numel": 100}},
                         layers, ResidualMemory())
    ex.submit("w", torch.randn(5000))
    ex.finish()
    before = ex.residuals()["w"].clone()
    g = torch.randn(5000)
    g[17] = float("nan")
    ex.submit("w", g)
    with pytest.raises(NonFiniteGradientError, match="non-finite gradient"):
        ex.finish()
    assert torch.equal(ex.residuals()["w"], before)
    ex.submit("w", torch.randn(5000))   # the next step runs normally
    assert ex.finish().averages["w"].abs().sum() > 0


@pytest.mark.skipif(not __import__("redsync_hvd.core.select", fromlist=["x"]).native_available(),
                    reason="native kernel not built")
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_exchange_with_fused_compensation_equals_the_unfused_exchange(momentum):
    """The compensation pass that also makes the selection's first pass (the native kernel)
    changes nothing that is sent or kept: 10 steps with threshold reuse, both paths."""
    def run(fused):
        layers = [Layer("b", (40,), 40, 0), Layer("w", (100000,), 100000, 1), Layer("v", (9000,), 9000, 2)]
        memory = MomentumCorrectionMemory(momentum, fuse=fused) if momentum else ResidualMemory(fuse=fused)
        ex = _local_exchange(
            {
                "method": "redsync",
                "density": 0.01,
                "selection": {"method": "tbs", "threshold_reuse": 3},
                "dgc": {"momentum_correction": bool(momentum)},
                "policy": {"min_compress_numel": 100},
            },
            layers,
            memory,
        )
        gen, outs = torch.Generator().manual_seed(5), []
        base = {l.name: torch.randn(l.numel, generator=gen) for l in layers}
        for step in range(10):
            for l in layers:   # a slowly drifting gradient: the reused threshold stays in band
                ex.submit(l.name, base[l.name] * 0.1 + 0.01 * torch.randn(l.numel, generator=gen))
            outs.append({k: v.clone() for k, v in ex.finish().averages.items()})
        return outs, memory, ex.compressor.selection_state

    (a, mem_a, sel_a), (b, mem_b, sel_b) = run(True), run(False)
    for step_a, step_b in zip(a, b):
        for name in step_a:
            # momentum correction: torch may round m*u + g once (FMA), the kernel twice
            assert torch.equal(step_a[name], step_b[name]) if not momentum else \
                torch.allclose(step_a[name], step_b[name], atol=1e-5)
    if not momentum:
        assert all(torch.equal(mem_a.residual[n], mem_b.residual[n]) for n in mem_a.residual)
        assert {n: s.state_dict() for n, s in sel_a.items()} == {n: s.state_dict() for n, s in sel_b.items()}


def test_cost_model_buckets_are_the_exchanges():
    """costmodel.sparse_buckets predicts the allgather buckets the exchange really builds."""
    from redsync_hvd.policy import costmodel as cm
    sizes = [300, 5000, 2_000_000, 10, 1_500_000, 800_000, 3_000_000, 64]
    layers = [Layer(f"l{i}", (n,), n, i) for i, n in enumerate(sizes)]
    ex = _local_exchange({"method": "redsync", "density": 0.01, "policy": {"min_compress_numel": 100}},
                         layers, ResidualMemory())   # the default fusion_bytes, 16 MiB
    built = [[l.index for l in b.layers] for b in ex.buckets if b.kind == "gather"]
    plan = [(l.numel, l.density, "sign_mean" if l.compressed else "dense") for l in layers]
    assert len(built) == 2 and sum(map(len, built)) == 6   # the two small ones stay dense
    assert built == cm.sparse_buckets(plan) == cm.sparse_buckets(plan, cm.BUCKET_BYTES)


def test_cost_model_network_probes_only_what_the_config_leaves_out():
    """latency_s / bandwidth_gbit: each one given is used as is, each one left out is probed
    (the probe's alpha is the framework's cost per collective round)."""
    from redsync_hvd.comm import LocalCommunicator
    from redsync_hvd.config import parse_compression
    from redsync_hvd.engine import network_for as _network
    comm = LocalCommunicator(2)
    both = _network(
        parse_compression(
            {"method": "redsync", "policy": {"mode": "cost_model", "latency_s": 1e-3, "bandwidth_gbit": 1.0}}
        ),
        comm,
    )
    assert (both.alpha, both.bandwidth) == (1e-3, 1.25e8)
    bw_only = _network(
        parse_compression({"method": "redsync", "policy": {"mode": "cost_model", "bandwidth_gbit": 1.0}}), comm
    )
    # the latency was measured (how much depends on this host's load): any finite figure of its own
    assert bw_only.bandwidth == 1.25e8 and 0.0 <= bw_only.alpha < float("inf")
    lat_only = _network(
        parse_compression({"method": "redsync", "policy": {"mode": "cost_model", "latency_s": 2e-3}}), comm
    )
    # the bandwidth was measured (a local "allreduce" is a memory copy), not taken from elsewhere
    assert lat_only.alpha == 2e-3 and 0 < lat_only.bandwidth < float("inf") and lat_only.bandwidth != 1.25e8
    assert _network(parse_compression({"method": "redsync"}), comm) is None


@pytest.mark.parametrize("memory", [ResidualMemory, lambda: MomentumCorrectionMemory(0.9)])
def test_dense_values_fp16_halves_the_dense_layers_bytes_and_rounds_only_them(memory):
    """policy.dense_values: fp16: the layers under min_compress_numel travel as fp16 (2 bytes an
    element, their average is the fp16 rounding of the fp32 one), the compressed layer's message
    is the one an fp32 run sends, an Inf or NaN in a dense layer still fails the step, and a
    budget counts the dense layers at 2 bytes."""
    from redsync_hvd.exchange import NonFiniteGradientError
    gen = torch.Generator().manual_seed(3)
    grads = [{"bias": torch.randn(10, generator=gen) / 3, "w": torch.randn(5000, generator=gen)} for _ in range(3)]

    def layers():
        return [Layer("bias", (10,), 10, 0), Layer("w", (5000,), 5000, 1)]

    def exchange(values):
        return _local_exchange({"method": "redsync", "density": 0.01, "policy": {
            "min_compress_numel": 100, "dense_values": values}}, layers(), memory())

    out = {}
    for values in ("fp32", "fp16"):
        ex, got = exchange(values), []
        for g in grads:
            for name, x in g.items():
                ex.submit(name, x.clone())
            got.append({k: v.clone() for k, v in ex.finish().averages.items()})
        out[values] = (got, ex.stats.last["wire_bytes[dense]"], ex.stats.last["wire_bytes[sparse]"])
    (f32, dense32, sparse32), (f16, dense16, sparse16) = out["fp32"], out["fp16"]
    assert dense32 == 4 * 10 and dense16 == 2 * 10 and sparse16 == sparse32
    for a, b in zip(f32, f16):
        assert not torch.equal(a["bias"], b["bias"]) and torch.equal(a["w"], b["w"])   # only the dense layer rounds
        if memory is ResidualMemory:   # ... to fp16 (with momentum correction, the momentum of fp16 averages)
            assert torch.equal(b["bias"], a["bias"].half().float())
        assert torch.allclose(b["bias"], a["bias"], rtol=2e-3, atol=1e-3)
    for bad in (float("inf"), float("nan")):   # fp16's clamp to the finite range must not hide an Inf
        ex = exchange("fp16")
        ex.submit("bias", grads[0]["bias"].clone().index_fill_(0, torch.tensor([3]), bad))
        ex.submit("w", grads[0]["w"].clone())
        with pytest.raises(NonFiniteGradientError, match="non-finite"):
            ex.finish()
    budgets = {}
    for values in ("fp32", "fp16"):
        _, cfg = build_compressor({"method": "redsync", "density": 0.01, "selection": {"method": "radix"}, "policy": {
            "mode": "budget", "min_compress_numel": 100, "dense_values": values, "budget": {"bytes_per_step": 2000}}})
        policy, budget_layers = LayerPolicy(cfg, build_compressor(cfg)[0]), layers()
        policy.setup(budget_layers, size=2)
        policy.start_budget(budget_layers, 4)
        budgets[values] = policy.budget.capacity
    assert budgets["fp16"] - budgets["fp32"] == 2 * 10                 # the bytes fp16 frees go to w
