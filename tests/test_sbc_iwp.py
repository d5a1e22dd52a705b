"""SBC's binarised message and IWP's importance, without communication."""
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.core.golomb import expected_bits
from redsync_hvd.memory import ResidualMemory


def layer(n, density):
    lay = Layer("w", (n,), n, 0, density=density)
    lay.selection = None
    return lay


def test_sbc_keeps_the_side_with_larger_mean_and_codes_positions():
    comp, _ = build_compressor({"method": "sbc", "density": 0.25})
    x = torch.tensor([3.0, -1.0, 0.5, -0.2, 2.0, -4.5, -4.0, 0.1])   # top-2: +{3,2} mean 2.5, -{4.5,4} mean 4.25
    msg = comp.compress(x, layer(8, 0.25), 0)
    assert sorted(msg.positions.tolist()) == [5, 6]
    assert msg.tensors[-1].item() == pytest.approx(-4.25)
    out = torch.zeros(8)
    comp.decompress_add(out, msg.tensors, layer(8, 0.25))
    assert out.tolist() == [0, 0, 0, 0, 0, -4.25, -4.25, 0]
    assert msg.tensors[0].dtype == torch.uint8          # Golomb-coded bytes on the wire


def test_sbc_message_size_follows_golomb_formula():
    n, p = 1_000_000, 0.01
    comp, _ = build_compressor({"method": "sbc", "density": p})
    msg = comp.compress(torch.randn(n, generator=torch.Generator().manual_seed(1)), layer(n, p), 0)
    bits = 8 * msg.nbytes()["indices"] / msg.selected
    assert bits == pytest.approx(expected_bits(p), rel=0.02)   # top-k positions of noise are ~uniform


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 300), rounds=st.integers(1, 5), density=st.floats(0.01, 1.0),
       binarize=st.booleans(), coding=st.sampled_from(["golomb", "raw"]), seed=st.integers(0, 999),
       fp16=st.booleans())
def test_sbc_conservation(n, rounds, density, binarize, coding, seed, fp16):
    """What was sent plus the residual is what went in, whatever the message: one mean, fp32
    values, or fp16 values (the residual keeps what their rounding left out)."""
    values = "fp16" if fp16 and not binarize else "fp32"
    comp, _ = build_compressor({"method": "sbc", "density": density,
                                "message": {"binarize": binarize, "index_coding": coding, "values": values}})
    mem, gen = ResidualMemory(), torch.Generator().manual_seed(seed)
    sent, total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for r in range(rounds):
        delta = torch.randn(n, generator=gen)
        total += delta.double()
        x = mem.compensate("w", delta).x
        msg = comp.compress(x, layer(n, density), r)
        assert msg.tensors[-1].dtype == (torch.float16 if values == "fp16" else torch.float32)
        out = torch.zeros(n)
        comp.decompress_add(out, msg.tensors, layer(n, density))
        mem.update(layer(n, density), x, msg, comp)
        sent += out.double()
        mem.commit()
    assert torch.allclose(sent + mem.residual["w"].double(), total, atol=1e-4)


def test_sbc_fp16_values_need_values():
    with pytest.raises(ValueError, match="binarize: false"):
        build_compressor({"method": "sbc", "message": {"values": "fp16"}})


class OneRank:
    rank, size = 0, 1

    def is_root(self, root):
        return root == self.rank

    def broadcast_async(self, tensor, root, name):
        return tensor

    def wait(self, handle):
        return handle


def test_iwp_importance_is_residual_over_weight():
    comp, _ = build_compressor({"method": "iwp", "density": 0.25, "selection": "exact"})
    comp.comm = OneRank()
    lay = layer(8, 0.25)
    lay.param = torch.tensor([100.0, 1.0, 1.0, 0.01, 1.0, 50.0, 1.0, 1.0])
    x = torch.tensor([10.0, 0.5, 0.1, 0.2, 0.3, 9.0, 0.4, 0.1])   # importance: .1 .5 .1 20 .3 .18 .4 .1
    msg = comp.compress(x, lay, 0)
    assert sorted(msg.positions.tolist()) == [1, 3]
    assert msg.nbytes() == {"indices": 8, "values": 8}     # this rank led: it broadcast the indices
    assert comp.leaders == [(0, 0)]


def test_iwp_in_a_one_process_world_selects_as_whichever_rank_leads():
    """LocalCommunicator(8) stands for 8 copies of this process (whatif's and the cost model's
    probes): whoever the step's leader is, this process selects as it and broadcasts its positions,
    so every step sends the leader's top-k, never an unfilled index buffer."""
    from redsync_hvd.comm import LocalCommunicator
    comp, _ = build_compressor({"method": "iwp", "density": 0.25, "selection": "exact"}, LocalCommunicator(8))
    lay = layer(8, 0.25)
    lay.param = torch.tensor([100.0, 1.0, 1.0, 0.01, 1.0, 50.0, 1.0, 1.0])
    x = torch.tensor([10.0, 0.5, 0.1, 0.2, 0.3, 9.0, 0.4, 0.1])
    for step in range(12):
        msg = comp.compress(x, lay, step)
        assert sorted(msg.positions.tolist()) == [1, 3], step
        assert msg.nbytes() == {"indices": 8, "values": 8}
    assert {leader for _, leader in comp.leaders} - {0}, comp.leaders   # ranks other than 0 led
