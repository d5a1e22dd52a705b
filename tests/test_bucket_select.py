"""Selecting a whole bucket at once (the ``histogram`` backend of tbs, core/select/histogram.py,
``selection.scope: bucket``).

The path exists for GPUs, where a host wait per layer costs more than the passes; it is
the same torch code on the CPU, so its results and its number of host waits are checked here.
"""
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode

from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer
from redsync_hvd.core.segments import Segments
from redsync_hvd.core.select import Contract, select
from redsync_hvd.memory import MomentumCorrectionMemory, ResidualMemory

BUCKET = Contract("tbs", backend="histogram")


def _tensors(sizes, seed, heavy=False):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=gen) for n in sizes]
    if heavy:   # a heavy tail: max|x| far above the k-th value
        xs = [x ** 3 for x in xs]
    return xs


def select_bucket(xs, ks, **kw):
    """The bucket backend over the layers ``xs`` laid out back to back."""
    return select(Segments([x.numel() for x in xs], ks), torch.cat(xs), BUCKET, **kw)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=5), density=st.floats(0.001, 1.0),
       seed=st.integers(0, 999), heavy=st.booleans())
def test_each_layer_gets_its_top_k_up_to_128_ulps(sizes, density, seed, heavy):
    xs = _tensors(sizes, seed, heavy)
    ks = [max(1, int(density * n)) for n in sizes]
    got = select_bucket(xs, ks)
    for x, k, idx, vals, selected in zip(xs, ks, got.parts(), got.parts(got.values), got.selected):
        a = x.abs()
        kth = torch.topk(a, k).values[-1]
        chosen = torch.zeros(x.numel(), dtype=torch.bool)
        chosen[idx] = True
        assert idx.numel() == chosen.sum(), "no index twice"
        assert (idx[1:] > idx[:-1]).all(), "ascending"
        assert torch.equal(vals, x[idx])
        assert k <= idx.numel() <= 2 * k and selected == idx.numel()
        assert (a[~chosen] <= a[chosen].min()).all(), "everything unsent is smaller than what was sent"
        # the threshold is the k-th value rounded down to 128 float ulps (2**-16 relative)
        assert a[chosen].min() >= kth * (1 - 2.0 ** -16)
        assert not got.nonfinite.any()


def test_sign_rules_and_means():
    xs = _tensors([5000, 300, 20000], seed=3)
    ks = [50, 3, 200]
    both = select_bucket(xs, ks)
    for sign, keep in (("pos", lambda v: v > 0), ("neg", lambda v: v < 0)):
        got = select_bucket(xs, ks, sign=sign, mean=True)
        for x, idx_all, idx, mean, selected, k in zip(xs, both.parts(), got.parts(), got.means.split(1),
                                                       got.selected, ks):
            expect = idx_all[keep(x[idx_all])]
            assert torch.equal(idx, expect), "the kept side of the same selection"
            assert selected == idx_all.numel() >= k
            assert torch.allclose(mean, x[idx].mean().reshape(1))
    got = select_bucket(xs, ks, sign="larger", mean=True)
    for x, idx_all, idx, mean in zip(xs, both.parts(), got.parts(), got.means.split(1)):
        v = x[idx_all]
        pos_wins = v[v > 0].abs().mean() >= v[v < 0].abs().mean()
        assert torch.equal(idx, idx_all[v > 0] if pos_wins else idx_all[v < 0])
        assert torch.allclose(mean, x[idx].mean().reshape(1))


def test_zeros_ties_and_nonfinite():
    xs = [torch.zeros(100), torch.full((1000,), 0.5), torch.randn(400), torch.randn(50)]
    xs[3][7] = float("inf")
    xs[2][1] = float("nan")
    got = select_bucket(xs, [5, 10, 4, 2])
    idx = got.parts()
    assert idx[0].numel() == 0, "an all-zero layer sends nothing"
    assert idx[1].tolist() == list(range(20)), "1000 ties: capped at 2k, the rest stays in the residual"
    assert got.nonfinite.tolist() == [False, False, True, True]
    assert idx[2].numel() == idx[3].numel() == 0
    with pytest.raises(ValueError, match="x: 1100 elements for a layout of 1500"):
        select(Segments([100, 1000, 400], [1, 1, 1]), torch.cat(xs[:2]), BUCKET)
    with pytest.raises(ValueError, match="sign='both' is not one of"):
        select_bucket(xs[:2], [1, 1], sign="both")


# ops whose result the host must wait for on a GPU (sizes or values read back)
_WAITING_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_consecutive",
                "aten::_unique2", "aten::repeat_interleave"}


class _CountWaits(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.waits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        bool_index = name == "aten::index" and any(t is not None and t.dtype == torch.bool for t in args[1])
        free_repeat = name == "aten::repeat_interleave" and kwargs.get("output_size") is not None
        if (name in _WAITING_OPS and not free_repeat) or bool_index:
            self.waits.append(name)
        return func(*args, **(kwargs or {}))


def _exchange(scope, n_layers, momentum=0.0, quantize="fp16"):
    from redsync_hvd.comm import LocalCommunicator
    from redsync_hvd.exchange import GradientExchange
    from redsync_hvd.policy import LayerPolicy
    layers = [Layer(f"l{i}", (20000 + 1000 * i,), 20000 + 1000 * i, i) for i in range(n_layers)]
    comm = LocalCommunicator(2)
    comp, cfg = build_compressor(
        {
            "method": "redsync",
            "density": 0.01,
            "selection": {"method": "tbs", "scope": scope},
            "dgc": {"momentum_correction": bool(momentum)},
            "message": {"quantize": quantize},
            "policy": {"min_compress_numel": 100},
        }
    )
    memory = MomentumCorrectionMemory(momentum) if momentum else ResidualMemory()
    return GradientExchange(layers, comp, comm, LayerPolicy(cfg), memory), layers


@pytest.mark.parametrize("quantize", ["fp16", "sign_mean"])
@pytest.mark.parametrize("n_layers", [2, 8])
def test_bucket_scope_waits_once_per_bucket(n_layers, quantize):
    """On a GPU every wait also stalls the CPU that queues the backward pass. The bucket path's
    one wait is a .tolist() of all its layers' counts (a CPU tensor's tolist dispatches no op,
    so this count cannot see it): no other op reads a value or a size back, however many
    layers the bucket has, whatever the message. The layer path waits several times per layer
    with sign_mean's per-layer means (which shows the count sees waits); fp16 values read back
    fewer sizes per layer, so only the bucket side is asserted for them."""
    counts = {}
    for scope in ("bucket", "layer"):
        ex, layers = _exchange(scope, n_layers, quantize=quantize)
        (bucket,) = ex.buckets
        assert bucket.together == (scope == "bucket")   # the bucket is one unit, or each layer is
        gen = torch.Generator().manual_seed(0)
        for step in range(2):       # the second step is the steady state (state, buffers exist)
            grads = {l.name: torch.randn(l.numel, generator=gen) for l in layers}
            with _CountWaits() as mode:
                for l in reversed(layers):
                    ex.submit(l.name, grads[l.name])
            ex.finish()
        counts[scope] = mode.waits
    assert counts["bucket"] == [], counts["bucket"]
    if quantize == "sign_mean":
        assert len(counts["layer"]) >= 2 * n_layers, counts["layer"]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_bucket_scope_exchange_conserves_the_gradient(momentum):
    """Over several steps, what was sent plus what is kept equals what came in (error feedback),
    with and without DGC's momentum correction; a NaN step changes nothing."""
    from redsync_hvd.exchange import NonFiniteGradientError
    ex, layers = _exchange("bucket", 3, momentum)
    gen = torch.Generator().manual_seed(1)
    total = {l.name: torch.zeros(l.numel, dtype=torch.float64) for l in layers}
    sent = {l.name: torch.zeros(l.numel, dtype=torch.float64) for l in layers}
    u = {l.name: torch.zeros(l.numel, dtype=torch.float64) for l in layers}
    for step in range(6):
        grads = {l.name: torch.randn(l.numel, generator=gen) for l in layers}
        if step == 3:
            before = {k: v.clone() for k, v in ex.residuals().items()}
            grads["l1"][5] = float("nan")
            for l in reversed(layers):
                ex.submit(l.name, grads[l.name])
            with pytest.raises(NonFiniteGradientError, match=r"\['l1'\]"):
                ex.finish()
            assert all(torch.equal(before[k], ex.residuals()[k]) for k in before)
            continue
        for l in reversed(layers):
            ex.submit(l.name, grads[l.name])
        out = ex.finish().averages
        for l in layers:
            g = grads[l.name].double()
            if momentum:   # what enters the residual is the velocity, masked where sent
                u[l.name] = momentum * u[l.name] + g
                total[l.name] += u[l.name]
                u[l.name][out[l.name] != 0] = 0.0
            else:
                total[l.name] += g
            sent[l.name] += out[l.name].double()
            assert out[l.name].count_nonzero() >= 1
    for l in layers:
        assert torch.allclose(sent[l.name] + ex.residuals()[l.name].double(), total[l.name], atol=1e-4)


def test_scope_config():
    with pytest.raises(ValueError, match="selection.scope=bucket .* set selection.method: tbs"):
        build_compressor({"method": "redsync", "selection": {"method": "trimmed", "scope": "bucket"}})
    with pytest.raises(ValueError, match="selection.scope=bucket"):
        build_compressor(
            {
                "method": "redsync",
                "selection": {"scope": "bucket"},
                "policy": {"layers": [{"pattern": "fc*", "selection": "exact"}]},
            }
        )
    with pytest.raises(ValueError, match="compression.selection.scope: Input should be 'auto', 'layer' or 'bucket'"):
        build_compressor({"method": "redsync", "selection": {"scope": "tensor"}})
    comp, _ = build_compressor({"method": "redsync"})   # auto: CPU layers select one by one
    assert not comp.selects_by_bucket([Layer("w", (10,), 10, 0)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_scope_selects_by_bucket_on_cuda_and_matches_the_cpu():
    comp, _ = build_compressor({"method": "redsync"})
    cuda = [Layer("w", (10,), 10, 0, device=torch.device("cuda"))]
    assert comp.selects_by_bucket(cuda)
    xs = _tensors([300000, 5000, 70000], seed=4)
    a = select_bucket(xs, [300, 5, 70], sign="pos", mean=True)
    b = select_bucket([x.cuda() for x in xs], [300, 5, 70], sign="pos", mean=True)
    assert torch.equal(a.positions, b.positions.cpu()) and torch.allclose(a.means, b.means.cpu())
