"""``selection.method: radix`` through the exchange: exactly k per layer, chosen on the device,
as the four steps of the pipeline over one flat buffer per bucket (compressors/exact_k.py).

On CPU tensors the steps run the torch reference of core/select/radix_ref.py (the Triton kernels
under the interpreter: tests/test_triton_select.py); a GPU runs the same calls as kernels.
"""
import math

import pytest
import torch

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.comm.packing import pack, unpack_fixed
from redsync_hvd.compressors import build_compressor
from redsync_hvd.compressors.base import Layer, Wire
from redsync_hvd.core.host_reads import HostReads
from redsync_hvd.core.select import native_available
from redsync_hvd.engine import MomentumSpec, build_exchange
from redsync_hvd.exchange import NonFiniteGradientError

AGREEMENT = ("tolist", "redsync_hvd.exchange.exchange:_read")   # finish()'s one read


class CountingComm(LocalCommunicator):
    """A one-process communicator that counts the collectives it is asked for."""

    def __init__(self, size):
        super().__init__(size)
        self.calls = []

    def allgather_async(self, tensor, name, sizes=None):
        self.calls.append(name)
        return super().allgather_async(tensor, name, sizes)


def make(sizes, selection="radix", quantize="sign_mean", momentum=0.9, world=2, density=0.01, **extra):
    layers = [Layer(f"l{i}", (n,), n, i) for i, n in enumerate(sizes)]
    spec = {"method": "redsync", "density": density, "selection": selection, "message": {"quantize": quantize},
            "dgc": {"momentum_correction": bool(momentum)}, "policy": {"min_compress_numel": 100}, **extra}
    mom = MomentumSpec(momentum if isinstance(momentum, dict) else dict.fromkeys((l.name for l in layers), momentum))
    comm = CountingComm(world)
    ex = build_exchange(spec, layers, comm, take_momentum=lambda: mom, agree=False).exchange
    return ex, layers, comm


def grads_for(layers, step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    return {l.name: torch.randn(l.numel, generator=gen).to(dtype) for l in layers}


def run_step(ex, layers, grads):
    for l in reversed(layers):
        ex.submit(l.name, grads[l.name])
    return ex.finish().averages


def sizes_of(n_layers):
    # big and small layers, and a few under min_compress_numel: those travel dense (allreduce)
    return [3000 + 157 * i if i % 7 else 40 + i for i in range(n_layers)]


@pytest.mark.parametrize("n_layers", [2, 8, 60])
def test_no_host_read_in_a_compressed_step(n_layers):
    """Submit of every layer, the collectives' start, the decode and the memory commit read
    nothing back, from the first step on (layouts and buffers are built inside the count),
    with DGC momentum and dense layers beside; the one read of a step is the agreed count of
    non-finite layers in finish(). The per-layer tbs path, counted the same way, reads many
    times (the count can fail)."""
    ex, layers, comm = make(sizes_of(n_layers), momentum=0.9)
    with HostReads() as reads:
        for step in range(2):
            run_step(ex, layers, grads_for(layers, step))
    assert reads.events == [AGREEMENT] * 2, reads.events
    assert all(ex.bucket_of[l.name] in ex.planned for l in layers if l.compressed)
    old, old_layers, _ = make(sizes_of(n_layers), selection={"method": "tbs", "scope": "bucket"})
    with HostReads() as reads:
        run_step(old, old_layers, grads_for(old_layers, 0))
    assert "redsync_hvd.core.select.histogram:select" in reads.where()   # its one wait per bucket
    assert "redsync_hvd.comm.packing:unpack_gathered" in reads.where()      # the header, on the host


def test_one_allgather_per_bucket_and_fixed_sizes():
    """Message sizes are known before the step: no header allgather (the tbs bucket path sends
    two collectives per bucket); a compressor whose message differs from what it declared, or
    a payload of another size, stops with an error that says so."""
    counts = {}
    for selection in ("radix", {"method": "tbs", "scope": "bucket"}):
        ex, layers, comm = make([20000, 9000, 4000], selection=selection, fusion_bytes=60000)
        run_step(ex, layers, grads_for(layers, 0))
        counts[str(selection)] = (len(ex.buckets), len(comm.calls),
                                  ex.communication_stats().get("bytes_headers", 0))
    assert counts["radix"] == (2, 2, 0)
    assert counts[str({"method": "tbs", "scope": "bucket"})][:2] == (2, 4)
    comp, _ = build_compressor({"method": "redsync", "selection": "radix", "density": 0.01,
                                "message": {"quantize": "sign_mean"}})
    layers = [Layer("a", (1000,), 1000, 0, density=0.01), Layer("b", (300,), 300, 1, density=0.01)]
    assert [comp.wire(l).counts for l in layers] == [(10, 1), (3, 1)] and comp.wire(layers[0]).fixed
    _, payload = pack([torch.zeros(13, dtype=torch.int32), torch.zeros(2)], "cpu")
    with pytest.raises(RuntimeError, match="ranks disagree on the bucket layout"):
        unpack_fixed(payload, [15, 2], [torch.int32, torch.float32], 1)
    # different momenta: a bucket of per-layer messages (not planned), whose sizes are checked
    ex, layers, comm = make([20000, 9000], momentum={"l0": 0.9, "l1": 0.5})
    assert not ex.planned
    wire = ex.compressor.wire
    ex.compressor.wire = lambda layer: Wire(wire(layer).dtypes, wire(layer).kinds, (1, 1), fixed=True)
    with pytest.raises(RuntimeError, match="declared fixed message sizes"):
        run_step(ex, layers, grads_for(layers, 0))


@pytest.mark.parametrize("quantize,momentum", [("sign_mean", 0.0), ("none", 0.9), ("fp16", {"l0": 0.9, "l1": 0.5})])
def test_exactly_k_and_sent_plus_residual_is_what_came_in(quantize, momentum):
    """Each layer's average has exactly k non-zeros (LocalCommunicator: every rank sends this
    rank's message); over steps, what was sent plus what is kept equals what came in (the
    velocity with DGC momentum; different momenta in a bucket take the per-layer compensation);
    a NaN step changes nothing on any layer and raises, naming the layer."""
    ex, layers, _ = make([12000, 7000, 3000], quantize=quantize, momentum=momentum, world=2, density=0.02)
    m = {l.name: momentum.get(l.name, 0.0) if isinstance(momentum, dict) else momentum for l in layers}
    total = {l.name: torch.zeros(l.numel, dtype=torch.float64) for l in layers}
    sent = {l.name: torch.zeros(l.numel, dtype=torch.float64) for l in layers}
    u = {l.name: torch.zeros(l.numel, dtype=torch.float64) for l in layers}
    for step in range(5):
        grads = grads_for(layers, step)
        if step == 2:
            before = {k: v.clone() for k, v in ex.residuals().items()}
            grads["l1"][7] = math.nan
            with pytest.raises(NonFiniteGradientError, match=r"\['l1'\]"):
                run_step(ex, layers, grads)
            assert all(torch.equal(before[k], ex.residuals()[k]) for k in before)
            continue
        out = run_step(ex, layers, grads)
        for l in layers:
            assert int((out[l.name] != 0).sum()) == l.k, (step, l.name)
            u[l.name] = m[l.name] * u[l.name] + grads[l.name].double()
            total[l.name] += u[l.name] if m[l.name] else grads[l.name].double()
            sent[l.name] += out[l.name].double()
            if m[l.name]:
                u[l.name][out[l.name] != 0] = 0.0   # masking
    for l in layers:
        kept = ex.residuals()[l.name].double()
        assert torch.allclose(sent[l.name] + kept, total[l.name], atol=1e-4), l.name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_gradients_stay_half_until_the_compensation(dtype):
    """fp16/bf16 gradients reach the compensation as they are (one half-precision flat buffer
    per bucket, no fp32 copy per layer) and give, bit for bit, what their fp32 values give;
    residuals and velocities are fp32."""
    runs = {}
    for d in (dtype, torch.float32):
        ex, layers, _ = make([6000, 2500, 50], momentum=0.9)
        outs = [run_step(ex, layers, {n: g.to(dtype).to(d) for n, g in grads_for(layers, s).items()})
                for s in range(3)]
        runs[d] = (outs, ex.residuals(), ex)
    (half, res_h, ex_h), (full, res_f, _) = runs[dtype], runs[torch.float32]
    for a, b in zip(half, full):
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(res_h[n], res_f[n]) and res_h[n].dtype == torch.float32 for n in res_f)
    assert all(u.dtype == torch.float32 for u in ex_h.residuals("velocity").values())
    assert [p.grad.dtype for p in ex_h.planned] == [dtype]   # the bucket's gradient buffer


def test_checkpoint_and_resume_through_the_flat_buffers():
    """Residuals and velocities live as views of flat buffers; a state_dict taken between steps,
    loaded into a fresh exchange, continues exactly as the uninterrupted one."""
    ex, layers, _ = make([5000, 3000, 800], momentum=0.9)
    for s in range(2):
        run_step(ex, layers, grads_for(layers, s))
    state = {k: v for k, v in ex.state_dict().items()}
    fresh, _, _ = make([5000, 3000, 800], momentum=0.9)
    fresh.load_state_dict(state)
    for s in range(2, 4):
        a, b = run_step(ex, layers, grads_for(layers, s)), run_step(fresh, layers, grads_for(layers, s))
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(r, fresh.residuals()[n]) for n, r in ex.residuals().items())


def test_config_refuses_what_radix_cannot_do():
    with pytest.raises(ValueError, match="selection.scope: bucket"):
        build_compressor({"method": "redsync", "selection": {"method": "radix", "scope": "layer"}})
    with pytest.raises(ValueError, match="index_coding: raw"):
        build_compressor({"method": "redsync", "selection": "radix", "message": {"index_coding": "golomb"}})
    with pytest.raises(ValueError, match="per-layer selection overrides"):
        build_compressor({"method": "redsync", "selection": "radix",
                          "policy": {"layers": [{"pattern": "fc*", "selection": "trimmed"}]}})
    comp, _ = build_compressor({"method": "redsync", "selection": "radix"})
    assert comp.selects_by_bucket([Layer("a", (10,), 10, 0)])     # auto: by bucket on any device


def test_sparse_update_applies_each_layers_slice_of_the_bucket():
    """sparse_update decodes a layer's part of every rank's bucket message straight into its
    weights (per layer: the bucket is not decoded flat then): p -= lr * average."""
    runs = []
    for sparse in (False, True):
        ex, layers, _ = make([5000, 3000], momentum=0.0, sparse_update=sparse)
        params = {l.name: torch.ones(l.numel) for l in layers}
        for s in range(2):
            for l in reversed(layers):
                ex.submit(l.name, grads_for(layers, s)[l.name])
            out = ex.finish(apply={n: (p, 0.1) for n, p in params.items()} if sparse else None).averages
            for n, p in params.items():
                if not sparse:
                    p.sub_(0.1 * out[n])
        runs.append(params)
        assert sorted(ex.last.applied) == (["l0", "l1"] if sparse else [])
    assert all(torch.allclose(runs[0][n], runs[1][n], atol=1e-7) and bool((runs[1][n] != 1).any())
               for n in runs[0])


def test_the_plan_says_which_path_runs():
    """On the CPU a planned bucket runs eagerly, and says so; cuda_graph accepts auto | on | off only."""
    ex, layers, _ = make([5000, 3000])
    run_step(ex, layers, grads_for(layers, 0))
    assert ex.paths() == ["bucket 0 (2 layers, 8000 elements): exact-k plan, eager"]
    with pytest.raises(ValueError, match="cuda_graph"):
        make([5000], cuda_graph="sometimes")


@pytest.mark.skipif(not native_available(), reason="the native CPU kernels are not built")
def test_native_backend_started_from_last_steps_kth_key_steps_as_the_reference(monkeypatch):
    """Large layers (the native backend's candidates path) over 60 steps of error feedback: once
    each layer's k-th key holds steady (the residual's growth slows after a few tens of steps),
    the planned bucket's hints start the search (one index pass above it), and every step's
    averages and residuals equal the torch reference's to the bit."""
    from redsync_hvd.core.select import native_radix
    tried = []
    real = native_radix._from_hint

    def spy(*a):
        got = real(*a)
        if a[-1] is not None:   # a hint was there to try
            tried.append(got is not None)
        return got
    monkeypatch.setattr(native_radix, "_from_hint", spy)
    sizes = [1 << 17, 3000, 1 << 16]
    runs = [make(sizes, selection={"method": "radix", "radix_backend": backend}, quantize="sign_mean",
                 momentum=0.0, density=0.002) for backend in ("native", "torch")]
    for step in range(60):
        grads = grads_for(runs[0][1], step)
        outs = [run_step(ex, layers, grads) for ex, layers, _ in runs]
        for name in outs[0]:
            assert torch.equal(outs[0][name], outs[1][name]), (step, name)
        res = [ex.residuals() for ex, _, _ in runs]
        assert all(torch.equal(res[0][k], res[1][k]) for k in res[0]), step
    assert len(tried) >= 40 and all(tried), tried   # tried on the later steps, and it found the candidates


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("quantize", ["sign_mean", "none"])
def test_cuda_graph_replays_the_eager_step_bit_for_bit(quantize):
    """The same gradients through cuda_graph: on and off, DGC momentum, a density warm-up whose
    stages change every layer's k (a new layout, captured anew) and a NaN step (rolled back, so
    the buffers' assignment differs from the step count's parity): every average and residual
    equal bit for bit, and the graphs were replayed."""
    results = []
    for mode in ("off", "on"):
        layers = [Layer(f"l{i}", (n,), n, i, torch.device("cuda")) for i, n in enumerate([40000, 9000, 3000])]
        spec = {"method": "redsync", "density": 0.01, "selection": "radix", "message": {"quantize": quantize},
                "dgc": {"momentum_correction": True}, "policy": {"min_compress_numel": 100}, "cuda_graph": mode,
                "warmup": {"steps": 6, "stages": 2, "start_density": 0.1}}
        mom = MomentumSpec(dict.fromkeys((l.name for l in layers), 0.9))
        ex = build_exchange(spec, layers, LocalCommunicator(2), take_momentum=lambda: mom, agree=False).exchange
        outs = []
        for step in range(12):
            grads = {n: g.cuda() for n, g in grads_for(layers, step).items()}
            if step == 7:
                grads["l1"][5] = math.nan
                with pytest.raises(NonFiniteGradientError):
                    run_step(ex, layers, grads)
                continue
            outs.append({n: t.clone() for n, t in run_step(ex, layers, grads).items()})
        results.append((outs, {n: r.clone() for n, r in ex.residuals().items()}, ex))
    (eager, r_eager, _), (graph, r_graph, ex) = results
    assert all(torch.equal(a[n], b[n]) for a, b in zip(eager, graph) for n in a)
    assert all(torch.equal(r_eager[n], r_graph[n]) for n in r_eager)
    assert all(p.graphs.replays > 0 for p in ex.planned), ex.paths()


def test_the_runner_logs_which_path_runs(tmp_path):
    """A run with planned buckets says in layers.log (and once on stdout) how each one runs."""
    from launch import train
    r = train(tmp_path, "configs/digits/redsync.yaml", "compression.selection.method=radix", "training.steps=6",
              "compression.warmup.epochs=0", "output.name=radix")
    logged = [line for line in (tmp_path / "radix" / "layers.log").read_text().splitlines() if "[path]" in line]
    assert logged and all("exact-k plan, eager" in line for line in logged), logged
    assert logged[0].startswith("[path] step 1: bucket ") and logged[0].split("] ", 1)[1] in r.stdout
