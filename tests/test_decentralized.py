"""Decentralized compressed training (redsync_hvd.decentralized): quantisers, topology,
exchange, DCD/ECD/naive/D-PSGD. Unit tests run in one process (an in-process, threaded
exchange stands in for MPI); the multi-process ones launch real `horovodrun` jobs."""
import json
import math

import numpy as np
import pytest
import torch
from launch import horovodrun, run_script

from redsync_hvd.decentralized import (
    FixedGridQuantizer,
    IdentityQuantizer,
    MinMaxQuantizer,
    ThreadedGroup,
    TopKSparsifier,
    build_algorithm,
    build_quantizer,
    check_world,
    from_config,
    from_matrix,
    from_yaml,
    optimizer_step_as_gradient,
    pack,
    ring,
    unpack,
)
from redsync_hvd.decentralized.quantizers import pack_codes, unpack_codes

# OpenMPI busy-polls while waiting; 4 ranks on 2 shared cores then starve each other (10x slower)
YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}


# ----------------------------------------------------------------------------- quantisers
def test_pack_codes_roundtrip():
    for bits in (8, 4, 2):
        for n in (0, 1, 3, 4, 5, 17):
            codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
            packed = pack_codes(codes, bits)
            assert packed.numel() == math.ceil(n * bits / 8)
            assert torch.equal(unpack_codes(packed, bits, n), codes)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_minmax_is_unbiased_within_its_variance_bound(bits):
    x = torch.randn(200, generator=torch.Generator().manual_seed(0))
    q, m = MinMaxQuantizer(bits), 5000
    # x repeated m times has the same min/max, hence the same grid: m independent roundings at once
    rep = x.repeat(m)
    d = q.decode(q.encode(rep, torch.Generator().manual_seed(1)), rep.numel()).view(m, -1)
    s = q.spacing(x)
    assert ((d - x.min()) / s - torch.round((d - x.min()) / s)).abs().max() < 1e-3   # values on the grid
    assert (d - x).abs().max() <= s * (1 + 1e-5)                                     # one step at most
    assert d.var(dim=0).max() <= s * s / 4 * 1.1                                     # variance bound
    # mean of m draws: std <= s / (2 sqrt(m)); 5 sigma over 200 elements
    assert (d.mean(0) - x).abs().max() <= 5 * s / (2 * math.sqrt(m)) + 1e-6


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_fixed_grid_is_unbiased_inside_its_range_and_clips_outside(bits):
    q = FixedGridQuantizer(bits, step=0.1)
    x = (torch.rand(300, generator=torch.Generator().manual_seed(2)) * 2 - 1) * q.limit
    m = 4000
    rep = x.repeat(m)
    d = q.decode(q.encode(rep, torch.Generator().manual_seed(3)), rep.numel()).view(m, -1)
    assert q.clipped == 0
    assert (d - x).abs().max() <= 0.1 * (1 + 1e-5)
    assert (d.mean(0) - x).abs().max() <= 5 * 0.1 / (2 * math.sqrt(m)) + 1e-6
    out = q.decode(q.encode(torch.tensor([10 * q.limit, -10 * q.limit, 0.0])), 3)
    assert out.tolist() == pytest.approx([q.limit, -q.limit, 0.0]) and q.clipped == 2
    assert q.k == (1 << (bits - 1)) - 1


def test_topk_unbiased_random_k_and_biased_top_k():
    x = torch.randn(100, generator=torch.Generator().manual_seed(4))
    q, m = TopKSparsifier(0.2), 20000
    # x repeated m times: random-k keeps each position with probability exactly k/n and scales by n/k
    rep = x.repeat(m)
    w = q.encode(rep, torch.Generator().manual_seed(5))
    assert w[0].numel() == 0.2 * rep.numel() and torch.equal(w[1], rep[w[0].long()] * 5)
    d = q.decode(w, rep.numel()).view(m, -1).double()
    std = x.abs().double() * math.sqrt((100 / 20 - 1) / m)          # per-element std of the mean (at most)
    assert ((d.mean(0) - x.double()).abs() <= 5 * std + 1e-9).all()
    b = TopKSparsifier(0.2, unbiased=False)
    d = b.decode(b.encode(x), 100)
    top = torch.topk(x.abs(), 20).indices
    assert torch.equal(d[top], x[top]) and (d != 0).sum() == 20     # exact top-k, unscaled: biased


def test_wire_bytes_and_message_sizes():
    x = torch.randn(1001)
    for bits in (8, 4, 2):
        w = MinMaxQuantizer(bits).encode(x)
        assert MinMaxQuantizer.wire_bytes(w) == math.ceil(1001 * bits / 8) + 8      # codes + (min, spacing)
        w = FixedGridQuantizer(bits, 0.1).encode(x)
        assert FixedGridQuantizer.wire_bytes(w) == math.ceil(1001 * bits / 8)      # codes only
    assert TopKSparsifier(0.1).wire_bytes(TopKSparsifier(0.1).encode(x)) == 101 * 8  # int32 + fp32 pairs
    assert IdentityQuantizer().wire_bytes(IdentityQuantizer().encode(x)) == 4004
    w = MinMaxQuantizer(4).encode(x)
    assert pack(w).nbytes == MinMaxQuantizer.wire_bytes(w) + 8 * (1 + 2 * 2)     # + int64 header


def test_encode_is_deterministic_given_the_generator_seed():
    x = torch.randn(500)
    for q in (MinMaxQuantizer(4), FixedGridQuantizer(2, 0.5), TopKSparsifier(0.1)):
        a = q.encode(x, torch.Generator().manual_seed(7))
        b = q.encode(x, torch.Generator().manual_seed(7))
        c = q.encode(x, torch.Generator().manual_seed(8))
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        assert not all(torch.equal(u, v) for u, v in zip(a, c))


def test_edge_cases_and_bad_knobs():
    q = MinMaxQuantizer(2)
    assert torch.equal(q.decode(q.encode(torch.full((5,), 3.25)), 5), torch.full((5,), 3.25))
    assert q.decode(q.encode(torch.zeros(0)), 0).numel() == 0
    with pytest.raises(ValueError, match="bits=3"):
        MinMaxQuantizer(3)
    with pytest.raises(ValueError, match="step"):
        FixedGridQuantizer(4, 0.0)
    with pytest.raises(ValueError, match="density"):
        TopKSparsifier(0.0)
    with pytest.raises(ValueError, match="quantizer='int8'"):
        build_quantizer("int8")
    with pytest.raises(ValueError, match="decentralized method 'gossip'"):
        build_algorithm("gossip", exchange=object())


def test_pack_unpack_roundtrip_mixed_dtypes():
    wire = [torch.randn(3), torch.arange(5, dtype=torch.uint8), torch.zeros(0), torch.tensor([7], dtype=torch.int32),
            torch.randn(2).double()]
    back = unpack(pack(wire))
    assert len(back) == len(wire) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(wire, back))
    with pytest.raises(ValueError, match="corrupt"):
        unpack(np.concatenate([pack(wire), np.zeros(1, np.uint8)]))


# ----------------------------------------------------------------------------- topology
def test_ring_matrices():
    assert ring(1).W.tolist() == [[1.0]] and ring(1).neighbors(0) == []
    assert ring(2).W.tolist() == [[0.5, 0.5], [0.5, 0.5]] and ring(2).neighbors(0) == [1]
    for n in (3, 4, 8):
        t = ring(n)
        assert torch.allclose(t.W.sum(0), torch.ones(n, dtype=torch.float64)) and torch.equal(t.W, t.W.T)
        assert t.neighbors(0) == sorted({1, n - 1}) and t.weights(0)[0] == pytest.approx(1 / 3)
        assert from_matrix(t.W.tolist()).second_eigenvalue < 1
    assert ring(4).second_eigenvalue == pytest.approx(1 / 3)


@pytest.mark.parametrize("matrix, size, message", [
    ("ring", None, "list of lists"),
    ([], None, "list of lists"),
    ([[0.5, 0.5], [1.0]], None, "not square"),
    ([[0.5, 0.5], [0.5, 0.5]], 3, "2 x 2 but there are 3 workers"),
    ([[1.5, -0.5], [-0.5, 1.5]], None, r"negative entry W\[0\]\[1\]"),
    ([[0.6, 0.4], [0.3, 0.7]], None, "not symmetric"),
    ([[0.5, 0.4], [0.4, 0.5]], None, "row 0 sums to 0.9"),
    ([[1, 0, 0], [0, 0.5, 0.5], [0, 0.5, 0.5]], None, r"not connected: workers \[1, 2\]"),
    ([[0, 1], [1, 0]], None, "eigenvalue -1"),
    ([["a", 1], [1, 0]], None, "must be numbers"),
    ([[float("nan"), 1], [1, 0]], None, "NaN"),
])
def test_mixing_matrix_validation_errors(matrix, size, message):
    with pytest.raises(ValueError, match=message):
        from_matrix(matrix, size=size)


def test_mixing_matrix_from_yaml(tmp_path):
    text = "[[0.5, 0.25, 0.25], [0.25, 0.75, 0.0], [0.25, 0.0, 0.75]]"
    t = from_yaml(text)
    assert t.neighbors(0) == [1, 2] and t.neighbors(1) == [0] and t.weights(1) == {0: 0.25, 1: 0.75}
    f = tmp_path / "w.yaml"
    f.write_text("mixing_matrix:\n  - [0.5, 0.5]\n  - [0.5, 0.5]\n")
    assert from_config(str(f), 2).W.tolist() == [[0.5, 0.5], [0.5, 0.5]]
    assert from_config("ring", 5).size == 5
    with pytest.raises(ValueError, match="mixing_matrix"):
        from_yaml("{weights: 1}")
    with pytest.raises(ValueError, match="3 x 3 but there are 4"):
        from_config(text, 4)


def test_world_mismatch_is_a_clear_error(monkeypatch):
    class OneProcessWorld:           # what mpi4py sees when Horovod was launched with --gloo
        def Get_size(self):
            return 1

        def Get_rank(self):
            return 0
    monkeypatch.setenv("HOROVOD_SIZE", "4")
    monkeypatch.setenv("HOROVOD_RANK", "2")
    with pytest.raises(RuntimeError, match="launch under `horovodrun` with the MPI controller"):
        check_world(OneProcessWorld())


# ----------------------------------------------------------------------------- algorithms, in process
def _random_run(method, n, steps, kw, state=None, seed=0):
    """Random models and gradients; returns per-rank (models, replicas, state_dict)."""
    def fn(ex):
        algo = build_algorithm(method, exchange=ex, seed=seed, **kw)
        gen = torch.Generator().manual_seed(10 + ex.rank)
        params = [torch.randn(n_, generator=gen) for n_ in (13, 40)]
        if state is not None:
            params = [p.clone() for p in state[ex.rank]["params"]]
            algo.load_state_dict(state[ex.rank]["algo"])
            gen.set_state(state[ex.rank]["gen"])
        for _ in range(steps):
            algo.step(params, [torch.randn(p.numel(), generator=gen) for p in params], 0.05)
        return {"params": [p.clone() for p in params], "algo": algo.state_dict(), "gen": gen.get_state(),
                "replicas": algo.replicas}
    return ThreadedGroup(ring(n)).run(fn)


@pytest.mark.parametrize("method, kw", [("dcd", dict(quantizer="minmax", bits=2)),
                                        ("ecd", dict(quantizer="grid", bits=4, step=0.1)),
                                        ("dcd", dict(quantizer="topk", density=0.2))])
@pytest.mark.parametrize("n", [2, 5])      # N=2: both ring neighbours are the same rank
def test_replicas_bit_identical_in_process(method, kw, n):
    out = _random_run(method, n, 12, kw)
    for r, o in enumerate(out):
        for j, reps in o["replicas"].items():
            if j == r:
                continue
            truth = out[j]["params"] if method == "dcd" else out[j]["replicas"][j]
            assert all(torch.equal(a, b) for a, b in zip(reps, truth)), (r, j)


@pytest.mark.parametrize("method", ["dcd", "ecd", "naive"])
def test_state_dict_resumes_bit_exactly(method):
    kw = dict(quantizer="minmax", bits=4)
    straight = _random_run(method, 3, 10, kw)
    half = _random_run(method, 3, 5, kw)
    resumed = _random_run(method, 3, 5, kw, state=half)
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        assert a["algo"]["t"] == b["algo"]["t"] == 10


def test_optimizer_step_as_gradient_applies_the_wrapped_optimizer():
    """Momentum SGD's displacement fed as the gradient (lr=1): one worker = the plain optimizer."""
    def fn(ex):
        a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
        b.load_state_dict(a.state_dict())
        oa, ob = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (a, b))
        algo = build_algorithm("dpsgd", exchange=ex)
        for step in range(3):
            for m in (a, b):
                m.zero_grad()
                m(torch.ones(1, 3) * step).sum().backward()
            oa.step()
            params = [p.data.view(-1) for p in b.parameters()]
            algo.step(params, optimizer_step_as_gradient(ob, list(b.parameters())), lr=1.0)
        return [torch.allclose(p, q, atol=1e-6) for p, q in zip(a.parameters(), b.parameters())]
    assert all(ThreadedGroup(ring(1)).run(fn)[0])


def _quadratic(method, n, steps, kw, lr=0.5):
    gen = torch.Generator().manual_seed(0)
    B = 0.5 * torch.randn(200, generator=gen) + 0.5 * torch.randn(n, 200, generator=gen)
    bbar = B.mean(0)

    def fn(ex):
        algo = build_algorithm(method, exchange=ex, seed=1, **kw)
        x = torch.zeros(200)
        errs = []
        for t in range(steps):
            algo.step([x], [x - B[ex.rank]], lr)
            if (t + 1) % (steps // 4) == 0:
                errs.append(float((algo.average_model([x])[0] - bbar).norm() / bbar.norm()))
        return errs, algo.stats()
    return ThreadedGroup(ring(n)).run(fn)[0]


def test_quadratic_8_workers_in_process():
    """A quadratic toy problem on an 8-worker ring (threads): DCD exact, ECD converging, naive stalled
    (the behaviours Tang et al., NeurIPS 2018, describe)."""
    dcd, st = _quadratic("dcd", 8, 240, dict(quantizer="minmax", bits=4))
    ecd, est = _quadratic("ecd", 8, 240, dict(quantizer="grid", bits=4, step=0.5))
    naive, _ = _quadratic("naive", 8, 240, dict(quantizer="minmax", bits=4))
    assert dcd[-1] < 1e-5 and st["degree"] == 2 and st["compression_ratio"] > 5, (dcd, st)
    assert ecd[-1] < 0.035 and ecd[-1] < 0.7 * ecd[0] and est["clipped"] == 0, (ecd, est)
    assert naive[-1] > 10 * max(dcd[-1], 1e-3) and naive[-1] > 0.5 * naive[0], naive
    assert naive[-1] > 2 * ecd[-1], (naive, ecd)


# ----------------------------------------------------------------------------- real horovodrun jobs
def test_replicas_bit_identical_4_workers():
    out = run_script("decentral_replicas.py", np=4, timeout=180, env=YIELD).stdout
    assert out.count("OK all replicas") == 4, out[-3000:]


def _results(stdout):
    dec, out = json.JSONDecoder(), {}
    for part in stdout.split("RESULT ")[1:]:
        r, _ = dec.raw_decode(part)
        out[r["name"]] = r
    return out


_QUAD = {}
_ALL = "dpsgd,dcd8,dcd4,ecd8,ecd4,naive4"


def quadratic(np_, names=_ALL, transport="horovod"):
    key = (np_, names, transport)
    if key not in _QUAD:
        if transport == "gloo":
            out = horovodrun(["--gloo", "python", "tests/mp/decentral_quadratic.py", names, "160"], np=np_,
                             timeout=180, env=YIELD).stdout
        else:
            out = run_script("decentral_quadratic.py", names, 160, transport, np=np_, timeout=180,
                             env=YIELD).stdout
        assert out.count("OK quadratic") == np_, out[-3000:]
        _QUAD[key] = _results(out)
    return _QUAD[key]


@pytest.mark.parametrize("np_", [4, 2])
def test_quadratic_toy_check(np_):
    """Errors are relative to ||bbar||; err_fp is the distance to uncompressed D-PSGD's fixed point
    (constant-lr decentralized SGD keeps each x_i an O(lr) bias away from bbar: err_workers)."""
    r = quadratic(np_)
    for name in ("dpsgd", "dcd8", "dcd4"):   # exact: the D-PSGD fixed point, whose average is the optimum
        assert r[name]["err_avg"] < 1e-5 and r[name]["err_fp"] < 1e-5, r[name]
        assert abs(r[name]["err_workers"] - r["dpsgd"]["err_workers"]) < 1e-5, r[name]
    assert r["ecd8"]["err_fp"] < 0.01 and r["ecd8"]["clipped"] == 0, r["ecd8"]
    ecd4 = r["ecd4"]                                                          # converging at O(1/sqrt(T))
    assert ecd4["err_fp"] < 0.06 and ecd4["clipped"] == 0, ecd4
    assert ecd4["hist"][-1][2] < 0.7 * ecd4["hist"][0][2], ecd4["hist"]
    naive = r["naive4"]                                                       # stalls, far from the others
    assert naive["err_fp"] > 10 * max(r["dcd4"]["err_fp"], 1e-3), naive
    assert naive["hist"][-1][2] > 0.7 * naive["hist"][0][2], naive["hist"]
    assert naive["err_fp"] > 2 * ecd4["err_fp"], (naive, ecd4)


def test_wire_bytes_per_worker_do_not_depend_on_n():
    two, four = quadratic(2), quadratic(4)
    for name in two:
        a, b = two[name], four[name]
        assert a["degree"] == 1 and b["degree"] == 2
        assert a["message_bytes"] == b["message_bytes"], name      # one message: same at N=2 and N=4
        for r in (a, b):                                           # one message per distinct neighbour
            assert r["bytes_per_step"] == r["degree"] * r["message_bytes"]
    header = 8 * (1 + 2 * 4)        # two tensors, two wire tensors each
    assert four["dcd8"]["message_bytes"] == header + 1000 + 2 * 8
    assert four["dcd4"]["message_bytes"] == header + 500 + 2 * 8
    assert four["ecd4"]["message_bytes"] == 8 * (1 + 2 * 2) + 500
    assert four["dpsgd"]["message_bytes"] == 8 * (1 + 2 * 2) + 4000


@pytest.mark.parametrize("transport", ["mpi4py", "gloo"])
def test_every_transport_delivers_the_same_bytes(transport):
    """Horovod over MPI (the default), mpi4py without Horovod and Horovod over Gloo carry the
    same messages, so a 2-worker run ends with the same errors, bit for bit, and the same bytes."""
    names = "dcd8,ecd4"
    ref, other = quadratic(2), quadratic(2, names, transport)   # quadratic(2) runs every config
    for name in names.split(","):
        assert other[name]["transport"] == ("horovod" if transport == "gloo" else transport)
        for key in ("err_avg", "err_fp", "err_workers", "hist", "message_bytes", "bytes_per_step"):
            assert other[name][key] == ref[name][key], (name, key, other[name][key], ref[name][key])


def test_mpi4py_transport_under_gloo_is_a_clear_error_not_a_hang():
    out = horovodrun(["--gloo", "python", "tests/mp/decentral_gloo.py"], np=2, timeout=90).stdout
    assert out.count("OK clear error") == 2 and "not --gloo" in out, out[-3000:]
