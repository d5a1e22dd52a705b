"""horovod.torch's DistributedOptimizer API on ours: Horovod's own optimizer tests under real
horovodrun (tests/mp/hvd_api.py: plain Horovod, ours with none, ours with RedSync at density 1,
compared in one job per world size), the keywords' one-line refusals, and NaN passed on with
check_finite off by every method (one process, the exchange as if 2 ranks sent the same)."""
import horovod.torch as hvd
import pytest
import torch
from launch import run_script

from redsync_hvd.comm import LocalCommunicator
from redsync_hvd.exchange import NonFiniteGradientError
from redsync_hvd.torch import DistributedOptimizer

CASES = ("broadcast_state_no_grad", "dynamic_requires_grad", "optimizer_process_sets", "sparse_embeddings",
         "synchronize_step_warning", "keywords", "sparse_nan")


@pytest.mark.parametrize("np", [2, 4])
def test_horovods_optimizer_tests_end_where_plain_horovod_ends(np):
    out = run_script("hvd_api.py", np=np, timeout=400, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}).stdout
    for case in CASES:
        for impl in ("none", "redsync"):
            assert out.count(f"OK {case} {impl}") == np, f"{case} {impl}\n{out[-3000:]}"
    assert out.count("OK hvd_api") == np, out[-3000:]


def _opt(compression=None, model=None, size=2, **kw):
    model = model or torch.nn.Linear(8, 4)
    return DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                compression=compression, communicator=LocalCommunicator(size), **kw)


@pytest.mark.parametrize("kw, match", [
    ({"op": hvd.Adasum}, "Adasum combines whole dense gradients"),
    ({"op": hvd.Max}, "not a gradient average or sum"),
    ({"op": hvd.Sum, "gradient_predivide_factor": 2.0}, "needs op=hvd.Average"),
    ({"gradient_predivide_factor": 0.0}, "finite number > 0"),
    ({"groups": 0}, "positive integer"),
    ({"groups": [[1.0]]}, "must consist of torch.Tensor"),
    ({"process_set": hvd.ProcessSet([0])}, "hvd.add_process_set"),
    ({"groups": 2, "compression": {"method": "none", "fusion_bytes": 1024}}, "both set the bucket size"),
    ({"op": hvd.Sum, "compression": {"method": "dcd"}}, "without a gradient average"),
    ({"op": hvd.Sum, "compression": {"method": "sbc"}}, "model deltas"),
    ({"op": hvd.Sum, "compression": {"method": "redsync", "sparse_update": True, "dgc": {"momentum_correction": False},
                                     "message": {"quantize": "none"}}}, "sparse_update"),
])
def test_what_horovods_keywords_cannot_do_here_is_refused_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        _opt(**kw)
    assert "\n" not in str(err.value)


def test_duplicate_parameter_in_groups_is_refused_as_horovod_refuses_it():
    model = torch.nn.Linear(8, 4)
    with pytest.raises(ValueError, match="only appear once"):
        _opt(model=model, groups=[[model.weight], [model.weight]])


def test_groups_set_about_that_many_buckets_and_num_groups_is_deprecated_as_in_horovod():
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16, bias=False) for _ in range(4)])
    assert len(_opt(model=model).exchange.buckets) == 1
    assert len(_opt(model=model, groups=4).exchange.buckets) == 4
    with pytest.warns(DeprecationWarning, match="num_groups"):
        assert len(_opt(model=model, num_groups=2).exchange.buckets) == 2
    assert len(_opt(model=model, groups=[[model[0].weight]]).exchange.buckets) == 1   # a list: no change


def test_set_backward_passes_per_step_is_checked():
    opt = _opt()
    opt.set_backward_passes_per_step(3)
    assert opt.backward_passes_per_step == 3
    with pytest.raises(ValueError, match="integer >= 1"):
        opt.set_backward_passes_per_step(0)


EVERY_METHOD = [
    {"method": "none"}, {"method": "fp16"}, {"method": "topk", "density": 0.1}, {"method": "randomk", "density": 0.1},
    {"method": "redsync", "density": 0.1},   # sign-mean messages, DGC momentum correction: velocities too
    {"method": "redsync", "density": 0.1, "selection": {"method": "radix"}, "message": {"quantize": "none"}},
    {"method": "qsgd"}, {"method": "signsgd"}, {"method": "powersgd", "rank": 2}, {"method": "iwp", "density": 0.1},
]


def _nan_in_weight(model, rows: int = 2):
    """A hook that puts NaN into the first ``rows`` rows of the weight's gradient, before it is
    accumulated (so the exchange's own hook receives it)."""
    return model.weight.register_hook(lambda g: g.index_fill(0, torch.arange(rows), float("nan")))


@pytest.mark.parametrize("compression", EVERY_METHOD, ids=lambda c: "-".join(map(str, c.values()))[:40])
def test_check_finite_off_passes_nan_on_and_every_method_keeps_its_state_finite(compression):
    """Step 1's weight gradient holds NaN: its average is non-finite (none: in exactly those
    rows), the bias's is not; the memory stays finite; step 2's averages are finite again (no
    NaN was kept in a residual, a velocity or PowerSGD's warm Q)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    # IWP's leader is drawn among the ranks, and a one-process stand-in can only lead as rank 0
    size = 1 if compression["method"] == "iwp" else 2
    opt = _opt({**compression, "check_finite": False, "policy": {"min_compress_numel": 0}}, model=model, size=size)
    x = torch.randn(16, 64)
    for step in range(3):
        hook = _nan_in_weight(model) if step == 1 else None
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.synchronize()
        if hook is not None:
            hook.remove()
        finite = torch.isfinite(model.weight.grad)
        assert finite.all() == (step != 1), (step, finite.sum())
        assert torch.isfinite(model.bias.grad).all()
        if compression["method"] == "none" and step == 1:
            assert not finite[:2].any() and finite[2:].all()
        for buffers in (getattr(opt.exchange.memory, "residual", {}), getattr(opt.exchange.memory, "velocity", {})):
            assert all(torch.isfinite(b).all() for b in buffers.values())
        for p in model.parameters():
            p.grad.nan_to_num_(0.0)
        with opt.skip_synchronize():
            opt.step()


def test_check_finite_on_raises_for_the_same_gradients():
    """RedSync keeps a residual: its default check raises, and says why it is on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = _opt({"method": "redsync", "local_steps": 1, "density": 0.1, "policy": {"min_compress_numel": 0}},
               model=model)   # under local steps the round fails instead (tests/mp/local_nonfinite.py)
    _nan_in_weight(model)
    model(torch.randn(16, 64)).pow(2).mean().backward()
    with pytest.raises(NonFiniteGradientError, match="'weight'.*on by default where the method keeps a residual"):
        opt.step()


@pytest.mark.parametrize("compression, keeps_residual", [
    ({"method": "none"}, False), ({"method": "fp16"}, False), ({"method": "qsgd"}, False),
    ({"method": "topk", "density": 0.1, "residual": False}, False), ({"method": "topk", "density": 0.1}, True),
    ({"method": "powersgd"}, True), ({"method": "none", "check_finite": True}, True),
], ids=lambda c: "-".join(map(str, c.values())) if isinstance(c, dict) else str(c))
def test_unset_check_finite_passes_nan_on_exactly_where_no_residual_is_kept(compression, keeps_residual):
    """As horovod.torch.DistributedOptimizer does, where nothing outlives the step; a residual
    (or the check set by name) raises instead."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = _opt({**compression, "policy": {"min_compress_numel": 0}}, model=model)
    assert opt.compression_config.finite_check == keeps_residual
    _nan_in_weight(model)
    model(torch.randn(16, 64)).pow(2).mean().backward()
    if keeps_residual:
        with pytest.raises(NonFiniteGradientError):
            opt.step()
        return
    opt.synchronize()
    assert not torch.isfinite(model.weight.grad).all() and torch.isfinite(model.bias.grad).all()


@pytest.mark.parametrize("check_finite", [True, False])
def test_sbc_finds_a_nan_delta_and_raises_or_passes_it_into_the_weights(check_finite):
    """SBC's top-k ranks NaN without a word: the exchange's own evidence finds it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = _opt({"method": "sbc", "density": 0.1, "local_steps": 1, "check_finite": check_finite,
                "policy": {"min_compress_numel": 0}}, model=model)
    _nan_in_weight(model)
    model(torch.randn(16, 64)).pow(2).mean().backward()
    if check_finite:
        with pytest.raises(NonFiniteGradientError, match="'weight'"):
            opt.step()
    else:
        opt.step()
        assert not torch.isfinite(model.weight).all() and torch.isfinite(model.bias).all()
    assert all(torch.isfinite(r).all() for r in opt.exchange.memory.residual.values())
