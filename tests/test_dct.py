"""method: dct (compressors/dct.py): the largest DCT coefficients of every block, DeMo's transmission.
The transform against its definition, what a message keeps, error feedback's identity, the wire
against the message, and the config's refusals. Under horovodrun and torchrun it runs in
tests/test_gpt.py (AdamW in update units, both engines bit for bit) and tests/test_costmodel.py
(the wire's bytes against the collectives')."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.compressors.dct import Blocks, _dct_matrix
from redsync_hvd.config import parse_compression
from redsync_hvd.config.compression import CompressionError


def layer(shape, density):
    return Layer("w", tuple(shape), math.prod(shape), 0, density=density)


def dct(**kw):
    return build_compressor({"method": "dct", **kw})[0]


def roundtrip(comp, x, lay):
    msg = comp.compress(x, lay, 0)
    out = torch.zeros_like(x)
    comp.decompress_add(out, msg.tensors, lay)
    return msg, out


def test_the_matrix_is_the_orthonormal_dct_ii():
    d = _dct_matrix(8, "cpu").double()
    assert torch.allclose(d @ d.T, torch.eye(8, dtype=torch.float64), atol=1e-6)
    x = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    i = torch.arange(8, dtype=torch.float64)
    by_definition = [(x * torch.cos(math.pi * (2 * i + 1) * k / 16)).sum() * math.sqrt((1 if k == 0 else 2) / 8)
                     for k in range(8)]
    assert torch.allclose(d @ x, torch.stack(by_definition), atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(shape=st.sampled_from([(100, 70), (5000,), (3, 4, 5, 6), (130, 1), (64, 64), (65, 129)]),
       chunk=st.sampled_from([2, 8, 64]))
def test_every_coefficient_sent_gives_the_layer_back(shape, chunk):
    """At density 1 with fp32 values the decode is the layer, padding and crop included."""
    x = torch.randn(math.prod(shape), generator=torch.Generator().manual_seed(1))
    msg, out = roundtrip(dct(density=1.0, values="fp32", chunk=chunk), x, layer(shape, 1.0))
    assert torch.allclose(out, x, atol=1e-5)
    blocks = Blocks(layer(shape, 1.0), chunk, 1.0)
    assert msg.selected == blocks.count * blocks.size


def test_a_message_keeps_k_per_block_and_more_of_a_smooth_layer_than_topk():
    """k = round(density * block) coefficients of every block, int16 positions; on a layer whose rows
    are smooth (a random walk along each row), k per block keep most of its energy, where the same
    count of coordinates (top-k) keeps a tenth: why a coefficient moves more than a weight."""
    shape, density = (512, 256), 0.01
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)).cumsum(1).reshape(-1)
    lay = layer(shape, density)
    msg, out = roundtrip(dct(density=density), x, lay)
    pos, values = msg.tensors
    assert pos.dtype == torch.int16 and values.dtype == torch.float16
    assert pos.numel() == (512 // 64) * (256 // 64) * round(density * 64 * 64) == msg.selected
    kept = 1 - (x - out).norm().item() ** 2 / x.norm().item() ** 2
    top = x.abs().topk(pos.numel()).values
    kept_by_topk = top.norm().item() ** 2 / x.norm().item() ** 2
    assert kept > 0.8 and kept_by_topk < 0.2, (kept, kept_by_topk)   # measured: 0.90 and 0.11


def test_error_feedback_keeps_exactly_what_the_receivers_did_not_get():
    """The residual is x minus the decode of the rank's own (fp16) message, so over any number of
    steps what was sent plus what is left equals what came in."""
    comp, lay = dct(density=0.01, chunk=16), layer((96, 80), 0.01)
    gen = torch.Generator().manual_seed(3)
    residual, total_in, total_sent = torch.zeros(lay.numel), torch.zeros(lay.numel), torch.zeros(lay.numel)
    for step in range(30):
        g = torch.randn(lay.numel, generator=gen)
        x = residual + g
        msg = comp.compress(x, lay, step)
        comp.decompress_add(x, msg.tensors, lay, alpha=-1.0)   # what the exchange's memory does
        residual = x
        comp.decompress_add(total_sent, msg.tensors, lay)
        total_in += g
    assert torch.allclose(total_sent + residual, total_in, atol=1e-3)
    assert residual.norm() < total_in.norm() * 3   # sent, not only kept


def test_the_wire_is_the_message():
    comp = dct(density=0.001)
    for shape in [(8745, 128), (4096, 2), (300, 300)]:
        lay = layer(shape, 0.001)
        msg = comp.compress(torch.randn(lay.numel), lay, 0)
        wire = comp.wire(lay)
        assert wire.fixed and sum(msg.nbytes().values()) == wire.nbytes(2)
    lay = layer((128, 128), 0.01)
    assert dct(density=0.01, values="fp32").wire(lay).nbytes() == 4 * round(0.01 * 4096) * 6


@pytest.mark.parametrize("bad, says", [
    ({"sparse_update": True}, "travels by allgather"),
    ({"aggregation": "sparse_reduce_scatter"}, "travels by allgather"),
    ({"dgc": {"momentum_correction": True}}, "set dgc.momentum_masking: false"),
    ({"chunk": 1}, "chunk"),
    ({"values": "bf16"}, "values"),
    ({"decay": 0.999, "feedback_units": "gradient"}, "set feedback_units: auto or update"),
    ({"sign_step": True, "residual": False}, "set feedback_units: auto or update"),
    ({"decay": 0}, "decay"),
])
def test_settings_it_cannot_run_name_the_fix(bad, says):
    with pytest.raises(CompressionError, match=says):
        parse_compression({"method": "dct", **bad})
    ok = parse_compression({"method": "dct", "dgc": {"momentum_correction": True, "momentum_masking": False}})
    assert ok.corrects_momentum and not ok.may_update_in_step


def test_demos_decay_fades_the_residual_and_its_sign_step_moves_every_weight_by_lr():
    """``decay``: x = decay * r + s, the worker's own Adam step s (memory/adam.py, checked by hand
    with Adam's formula); ``sign_step``: the adapter moves each sent weight by lr * sign(average) plus
    AdamW's decay (torch/update_units.py). Both need update units: under SGD the build says so."""
    from redsync_hvd.comm import LocalCommunicator
    from redsync_hvd.engine import build_exchange
    from redsync_hvd.memory import AdamUnitsMemory
    from redsync_hvd.torch.params import layers_of, take_momentum
    from redsync_hvd.torch.update_units import UpdateUnitsStep, take_moments

    b1, b2, eps, decay = 0.9, 0.99, 1e-8, 0.5
    mem = AdamUnitsMemory({"w": (b1, b2)}, {"w": eps}, decay=decay)
    gen = torch.Generator().manual_seed(5)
    m, v, r = torch.zeros(6), torch.zeros(6), torch.zeros(6)
    for t in range(1, 5):
        g = torch.randn(6, generator=gen)
        x = mem.compensate("w", g).x
        mem.commit()   # nothing sent: the residual is x
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        r = decay * r + (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        assert torch.allclose(x, r, rtol=1e-5, atol=1e-6), t

    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    named = list(model.named_parameters())
    names = {p: n for n, p in named}
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    spec = {"method": "dct", "density": 0.01, "decay": 0.999, "sign_step": True}
    built = build_exchange(spec, layers_of(named), LocalCommunicator(1),
                           take_momentum=lambda: take_momentum(opt.param_groups, names),
                           take_moments=lambda: take_moments(opt, names))
    memory = built.exchange.memory
    assert (memory.decay, memory.sign_step) == (0.999, True)
    w = model[0].weight
    before, average = w.detach().clone(), torch.randn(w.shape, generator=gen) * 1e-3
    w.grad, memory.sent = average.clone(), {"0.weight"}
    stepper = UpdateUnitsStep(opt, {w: "0.weight"}, memory)
    stepper.apply()
    assert w.grad is None   # hidden from the optimizer, which must not step it again
    assert torch.allclose(w.detach(), before * (1 - 0.01 * 0.1) - 0.01 * average.sign())
    stepper.restore()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="train with torch.optim.Adam or AdamW"):
        build_exchange({**spec, "dgc": {"momentum_correction": False}}, layers_of(named), LocalCommunicator(1),
                       take_momentum=lambda: take_momentum(sgd.param_groups, names),
                       take_moments=lambda: take_moments(sgd, names))
