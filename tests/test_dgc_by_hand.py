"""DGC's momentum correction, factor masking and density warm-up through the real exchange, against
Lin et al. (ICLR 2018), Algorithm 4, on 8 elements, by hand. With momentum m, per worker:

    u <- m*u + g            (momentum correction)
    v <- v + u              (local accumulation)
    send top-k of v;  v[sent] <- v[sent] - what receivers decode;  u[sent] <- 0   (factor masking)

m = 0.5 and small binary fractions keep every number exact in float32. Two ranks with the same
gradients (a one-process transport that stands for 2 ranks): the average is one rank's message.
"""
import pytest
import torch

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.exchange import GradientExchange
from redsync_hvd.memory import MomentumCorrectionMemory
from redsync_hvd.policy import LayerPolicy

G = [[8, -6, 2, 1, 0, 0, -1.5, 0.5],
     [0.5, 2, 0, 1, 0, 0, 0.25, 0],
     [0, 0, 0, 1, 0, 0, -4, 0]]


def exchange(compression, masking=True):
    comm = LocalCommunicator(2)
    comp, cfg = build_compressor({"method": "redsync", "selection": {"method": "exact"},
                                  "dgc": {"momentum_correction": True, "momentum_masking": masking},
                                  "policy": {"min_compress_numel": 0}, **compression}, comm)
    memory = MomentumCorrectionMemory(0.5, masking=masking)
    return GradientExchange([Layer("w", (8,), 8, 0)], comp, comm, LayerPolicy(cfg), memory), memory


def run(ex, memory):
    """(average sent, v, u) after each step."""
    out = []
    for g in G:
        ex.submit("w", torch.tensor(g, dtype=torch.float32))
        avg = ex.finish().averages["w"].clone()
        out.append((avg.tolist(), memory.residual["w"].tolist(), memory.velocity["w"].tolist()))
    return out


def test_values_with_warmup_equal_dgc_by_hand():
    """Density 0.25 after a 2-step warm-up from 0.5 in 2 stages: k = 4, then ceil(8 * 0.5 * 0.5**0.5) = 3,
    then 2 (DGC's exponential schedule)."""
    ex, memory = exchange({"density": 0.25, "message": {"quantize": "none"},
                           "warmup": {"steps": 2, "stages": 2, "start_density": 0.5}})
    got = run(ex, memory)
    # step 1, k = 4: u = g = v = [8, -6, 2, 1, 0, 0, -1.5, .5]; top 4 of |v|: 0, 1, 2, 6
    assert got[0] == ([8, -6, 2, 0, 0, 0, -1.5, 0],
                      [0, 0, 0, 1, 0, 0, 0, 0.5],           # v minus what was sent
                      [0, 0, 0, 1, 0, 0, 0, 0.5])           # u masked where sent
    # step 2, k = 3: u = .5u + g = [.5, 2, 0, 1.5, 0, 0, .25, .25]; v += u: [.5, 2, 0, 2.5, 0, 0, .25, .75]
    # top 3: 3 (2.5), 1 (2), 7 (.75)
    assert got[1] == ([0, 2, 0, 2.5, 0, 0, 0, 0.75],
                      [0.5, 0, 0, 0, 0, 0, 0.25, 0],
                      [0.5, 0, 0, 0, 0, 0, 0.25, 0])
    # step 3, k = 2: u = [.25, 0, 0, 1, 0, 0, .125 - 4, 0]; v = [.75, 0, 0, 1, 0, 0, -3.625, 0]; top 2: 6, 3
    assert got[2] == ([0, 0, 0, 1, 0, 0, -3.625, 0],
                      [0.75, 0, 0, 0, 0, 0, 0, 0],
                      [0.25, 0, 0, 0, 0, 0, 0, 0])
    assert ex.layers["w"].k == 2


def test_sign_mean_with_masking_by_hand():
    """RedSync's sign-mean message at k = 3 (density 0.375): of the top 3, the positive ones on even
    steps, the negative ones on odd steps, all sent as their mean. The residual keeps each one's
    difference from the mean, while masking zeroes its velocity."""
    ex, memory = exchange({"density": 0.375, "message": {"quantize": "sign_mean", "sign_rule": "alternate"}})
    got = run(ex, memory)
    # step 1 (+): v = g; top 3: 0 (8), 1 (-6), 2 (2); positive: 0, 2, mean 5
    assert got[0] == ([5, 0, 5, 0, 0, 0, 0, 0],
                      [3, -6, -3, 1, 0, 0, -1.5, 0.5],
                      [0, -6, 0, 1, 0, 0, -1.5, 0.5])
    # step 2 (-): u = .5u + g = [.5, -1, 0, 1.5, 0, 0, -.5, .25]; v = [3.5, -7, -3, 2.5, 0, 0, -2, .75]
    # top 3: 1 (-7), 0 (3.5), 2 (-3); negative: 1, 2, mean -5
    assert got[1] == ([0, -5, -5, 0, 0, 0, 0, 0],
                      [3.5, -2, 2, 2.5, 0, 0, -2, 0.75],
                      [0.5, 0, 0, 1.5, 0, 0, -0.5, 0.25])
    # step 3 (+): u = [.25, 0, 0, 1.75, 0, 0, -4.25, .125]; v = [3.75, -2, 2, 4.25, 0, 0, -6.25, .875]
    # top 3: 6 (-6.25), 3 (4.25), 0 (3.75); positive: 3, 0, mean 4
    assert got[2] == ([4, 0, 0, 4, 0, 0, 0, 0],
                      [-0.25, -2, 2, 0.25, 0, 0, -6.25, 0.875],
                      [0, 0, 0, 0, 0, 0, -4.25, 0.125])


def test_without_masking_the_velocity_keeps_pushing_what_was_sent():
    ex, memory = exchange({"density": 0.25, "message": {"quantize": "none"}}, masking=False)
    got = run(ex, memory)
    # step 1: top 2 of g: 0, 1; u stays g
    assert got[0] == ([8, -6, 0, 0, 0, 0, 0, 0], [0, 0, 2, 1, 0, 0, -1.5, 0.5], [8, -6, 2, 1, 0, 0, -1.5, 0.5])
    # step 2: u = [4.5, -1, 1, 1.5, 0, 0, -.5, .25]; v = [4.5, -1, 3, 2.5, 0, 0, -2, .75]; top 2: 0, 2
    assert got[1] == ([4.5, 0, 3, 0, 0, 0, 0, 0], [0, -1, 0, 2.5, 0, 0, -2, 0.75],
                      [4.5, -1, 1, 1.5, 0, 0, -0.5, 0.25])


def test_stale_masking_zeroes_only_the_velocity_of_what_waited_long():
    """``momentum_masking: stale`` masks u where |v| (1 - m) > |u| at the position sent: under m = 0.5,
    where the value sent is more than twice the velocity (it waited more than about 2 steps)."""
    ex, memory = exchange({"density": 0.25, "message": {"quantize": "none"}}, masking="stale")
    got = run(ex, memory)
    # step 1: v = u = g; top 2: 0, 1, each |v| = |u|: kept
    assert got[0] == ([8, -6, 0, 0, 0, 0, 0, 0], [0, 0, 2, 1, 0, 0, -1.5, 0.5], [8, -6, 2, 1, 0, 0, -1.5, 0.5])
    # step 2: u = [4.5, -1, 1, 1.5, 0, 0, -.5, .25]; v = [4.5, -1, 3, 2.5, 0, 0, -2, .75]; top 2: 0, 2.
    # At 0 |v| = |u| (sent the step before): kept; at 2 |v| = 3 > 2 |u| = 2 (it waited): masked
    assert got[1] == ([4.5, 0, 3, 0, 0, 0, 0, 0], [0, -1, 0, 2.5, 0, 0, -2, 0.75],
                      [4.5, -1, 0, 1.5, 0, 0, -0.5, 0.25])
    # step 3: u = [2.25, -.5, 0, 1.75, 0, 0, -4.25, .125]; v = [2.25, -1.5, 0, 4.25, 0, 0, -6.25, .875];
    # top 2: 6 (6.25 < 2 * 4.25: kept), 3 (4.25 > 2 * 1.75: masked)
    assert got[2] == ([0, 0, 0, 4.25, 0, 0, -6.25, 0], [2.25, -1.5, 0, 0, 0, 0, 0, 0.875],
                      [2.25, -0.5, 0, 0, 0, 0, -4.25, 0.125])


def dgc_reference(grads, k, m, nesterov, steps):
    """Algorithm 4 of Lin et al. written out for one worker (values sent, top-k exact)."""
    u = torch.zeros_like(grads[0], dtype=torch.float64)
    v = torch.zeros_like(u)
    sent = []
    for t in range(steps):
        g = grads[t].double()
        if nesterov:    # DGC's Nesterov: u = m(u + g); v += u + g (u here is DGC's u / m)
            u = m * u + g
            v = v + g + m * u
        else:
            u = m * u + g
            v = v + u
        idx = v.abs().topk(k).indices
        out = torch.zeros_like(v)
        out[idx] = v[idx]
        v[idx] = 0
        u[idx] = 0
        sent.append(out)
    return sent, v, u


@pytest.mark.parametrize("nesterov", [False, True])
def test_exchange_equals_dgc_algorithm_on_random_gradients(nesterov):
    n, k, m, steps = 200, 7, 0.9, 12
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4 for _ in range(steps)]
    comm = LocalCommunicator(2)
    comp, cfg = build_compressor({"method": "redsync", "density": (k - 0.5) / n, "selection": {"method": "exact"},
                                  "message": {"quantize": "none"}, "dgc": {"momentum_correction": True},
                                  "policy": {"min_compress_numel": 0}}, comm)
    memory = MomentumCorrectionMemory(m, nesterov=nesterov)
    ex = GradientExchange([Layer("w", (n,), n, 0)], comp, comm, LayerPolicy(cfg), memory)
    sent, v, u = dgc_reference(grads, k, m, nesterov, steps)
    for t in range(steps):
        ex.submit("w", grads[t].clone())
        assert torch.allclose(ex.finish().averages["w"].double(), sent[t], atol=1e-5), t
    assert torch.allclose(memory.residual["w"].double(), v, atol=1e-5)
    assert torch.allclose(memory.velocity["w"].double(), u, atol=1e-5)


@pytest.mark.parametrize("masking", [True, False, "stale"])
def test_at_density_one_masking_leaves_plain_sgd(masking):
    """Every position is sent every step, so factor masking zeroes the whole velocity every step:
    DGC's equations then apply the gradient itself (plain SGD, no momentum), a factor 1 - m of
    momentum SGD's steady step. Without masking they are momentum SGD on the averaged gradient,
    and so with stale masking: no value waited, v = u at every position sent.
    A position sent every T steps keeps 1 - m (1 - m**T) / (T (1 - m)) of momentum SGD's step
    under a constant gradient (docs/redsync.md)."""
    comm = LocalCommunicator(2)
    comp, cfg = build_compressor({"method": "redsync", "density": 1.0, "selection": {"method": "exact"},
                                  "message": {"quantize": "none"}, "policy": {"min_compress_numel": 0},
                                  "dgc": {"momentum_correction": True, "momentum_masking": masking}}, comm)
    ex = GradientExchange([Layer("w", (4,), 4, 0)], comp, comm, LayerPolicy(cfg),
                          MomentumCorrectionMemory(0.5, masking=masking))
    u = torch.zeros(4)
    for g in ([1.0, 2, -1, 0], [1.0, 0, 1, 4], [0.5, 0.5, 0, -2]):
        g = torch.tensor(g)
        ex.submit("w", g.clone())
        u = 0.5 * u + g
        assert torch.equal(ex.finish().averages["w"], g if masking is True else u)
