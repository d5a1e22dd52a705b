"""A new selection backend is one file: registered from here, it runs a bucket through the exchange.

The toy below is a radix backend (exactly k per layer, a bucket at a time) written with
torch.topk: it offers ``select`` only, so the torch reference compensates and decodes for it
(``core/select/radix.py``). Registered under a name, ``selection.radix_backend`` names it and
the planned bucket runs it; no file of the package knows it.
"""
import pytest
import torch

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.compressors.base import Layer
from redsync_hvd.core.segments import Segments
from redsync_hvd.core.select import Contract, names, pick, registry, select
from redsync_hvd.core.wire import to_wire
from redsync_hvd.engine import MomentumSpec, build_exchange


class ToyRadix:
    """Exactly k per layer by torch.topk of |x| (no sign rule), positions ascending."""
    calls = 0

    @classmethod
    def select(cls, seg, x, R, active, k_rows, first, index_dtype, value_dtype, mean, update, velocity):
        if R != 1 or mean or velocity is not None:
            raise ValueError("the toy ranks |x| and sends values, without DGC's masking")
        cls.calls += 1
        pos, vals, bad = [], [], []
        for v, k in zip(seg.views(x), seg.ks):
            p = torch.sort(torch.topk(v.abs(), k, sorted=False).indices).values
            sent = to_wire(v[p], value_dtype)
            if update:   # error feedback in the same pass: x keeps what was not sent
                v[p] -= sent.float()
            pos.append(p.to(index_dtype))
            vals.append(sent)
            bad.append(~torch.isfinite(v).all())
        kth = torch.zeros(len(seg), dtype=torch.int32)
        return torch.cat(pos), torch.cat(vals), None, torch.stack(bad), kth, None


@pytest.fixture
def toy():
    backend = registry.register(registry.Backend("toy", ("radix",), lambda: ToyRadix, unit="bucket"))
    ToyRadix.calls = 0
    yield backend
    registry.unregister("toy")


def test_a_registered_backend_is_a_choice_and_runs_the_entry_point(toy):
    assert "toy" in names("radix") and "toy" not in names("tbs")
    assert pick("radix", "cpu", choice="toy")[0] is toy
    seg = Segments([300, 50, 1000], [3, 50, 10])
    x = torch.randn(seg.n, generator=torch.Generator().manual_seed(0))
    got = select(seg, x.clone(), Contract("radix", backend="toy"))
    want = select(seg, x.clone(), Contract("radix", backend="torch"))
    assert ToyRadix.calls == 1 and got.counts == want.counts == seg.ks
    assert torch.equal(got.positions, want.positions) and torch.equal(got.values, want.values)


def exchange(backend):
    layers = [Layer(f"l{i}", (n,), n, i) for i, n in enumerate([3000, 800, 5000])]
    spec = {"method": "redsync", "density": 0.01, "message": {"quantize": "none"},
            "selection": {"method": "radix", "radix_backend": backend}, "policy": {"min_compress_numel": 100},
            "dgc": {"momentum_correction": False}}
    ex = build_exchange(spec, layers, LocalCommunicator(2), take_momentum=lambda: MomentumSpec({}),
                        agree=False).exchange
    return ex, layers


def test_a_bucket_runs_through_the_toy_backend_as_through_the_reference(toy):
    """Three steps of a planned bucket (error feedback, values sent in fp32) on the toy and on the
    torch reference: the same averages and residuals."""
    runs = {}
    for backend in ("toy", "torch"):
        ex, layers = exchange(backend)
        (planned,) = ex.planned
        assert planned.contract.backend == backend
        out = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            for l in reversed(layers):
                ex.submit(l.name, torch.randn(l.numel, generator=gen))
            out.append({n: a.clone() for n, a in ex.finish().averages.items()})
        runs[backend] = out, {n: r.clone() for n, r in ex.residuals().items()}
    assert ToyRadix.calls == 3
    (toy_out, toy_res), (ref_out, ref_res) = runs["toy"], runs["torch"]
    for a, b in zip(toy_out, ref_out):
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(toy_res[n], ref_res[n]) for n in ref_res)


def test_a_backend_the_registry_does_not_know_is_refused_when_the_compressor_is_built():
    with pytest.raises(ValueError, match="selection backend 'nope' does not run 'radix'; registered: auto"):
        exchange("nope")
