"""horovod.torch's own optimizer tests, on plain Horovod and on ours, compared in one job.

Each case is one of Horovod 0.28.1's test/parallel/test_torch.py tests (same model, optimizer
and checks), run three times in this process: with ``horovod.torch.DistributedOptimizer``, with
ours and ``method: none``, and with ours and RedSync at density 1 (every element sent,
unquantised, no momentum correction: an exact average). Horovod's own checks must hold for
all three, and ours must end where plain Horovod ends: bit for bit, except RedSync at more
than 2 ranks, whose decode adds the ranks' messages in rank order where MPI's allreduce sums
in its own order (within 1e-5 relative there: an ulp at first, grown by the steps of a loop
that diverges). Cases whose gradients go NaN compare NaN positions: ours must be non-finite
wherever Horovod is.

Prints ``OK <case> <impl>`` per case and implementation, ``OK hvd_api`` at the end.
"""
import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F

import redsync_hvd.torch as rhvd
from redsync_hvd.exchange import NonFiniteGradientError

EXACT = {"method": "redsync", "local_steps": 1, "density": 1.0, "message": {"quantize": "none"},
         "dgc": {"momentum_correction": False},
         "policy": {"min_compress_numel": 0}, "selection": {"method": "tbs"}}
IMPLS = {"horovod": None, "none": {"method": "none"}, "redsync": EXACT}


def wrap(impl, opt, named=None, compression=None, **kw):
    if impl == "horovod":
        return hvd.DistributedOptimizer(opt, named_parameters=named, **kw)
    return rhvd.DistributedOptimizer(opt, named_parameters=named, compression={**IMPLS[impl], **(compression or {})},
                                     **kw)


def broadcast_optimizer_state(impl):
    return hvd.broadcast_optimizer_state if impl == "horovod" else rhvd.broadcast_optimizer_state


def check(ours: dict, theirs: dict, impl: str, case: str) -> None:
    """ours == theirs, tensor by tensor (NaN equal to NaN); RedSync above 2 ranks within 1e-5."""
    exact = impl != "redsync" or hvd.size() <= 2
    for key, value in theirs.items():
        try:
            torch.testing.assert_close(ours[key], value, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-7,
                                       equal_nan=True)
        except AssertionError as exc:
            raise AssertionError(f"{case} {impl}: {key} differs from plain Horovod's: {exc}") from None


def check_passed_on(ours: dict, theirs: dict, impl: str, case: str) -> None:
    """Where Horovod's values are NaN/Inf ours are too, and where ours are finite they equal
    Horovod's: ours passes NaN on per layer where Horovod passes it per element."""
    for key, value in theirs.items():
        mine = ours[key]
        assert (~torch.isfinite(mine) | torch.isfinite(value)).all(), f"{case} {impl}: {key} finite, Horovod's not"
        finite = torch.isfinite(mine)
        check({key: mine[finite]}, {key: value[finite]}, impl, case)


# -- test_broadcast_state_no_grad -------------------------------------------------------------
class ModelNoGrad(torch.nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.a = torch.nn.Parameter(a.int(), requires_grad=False)
        self.b = torch.nn.Parameter(b)

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


def broadcast_state_no_grad(impl, _sets):
    """Horovod's checks, then two steps: the zero .grad the broadcast left must be usable."""
    torch.manual_seed(1)
    model = ModelNoGrad(torch.Tensor([1, 3]), torch.rand(4) + hvd.rank())
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    opt = wrap(impl, opt, model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_optimizer_state(impl)(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    bgrad = hvd.broadcast(grad, root_rank=0)
    assert opt.param_groups[0]["params"][0].grad is None
    assert torch.all(torch.eq(grad, bgrad)).item()
    after_broadcast = {"b0": model.b.detach().clone(), "m0": opt.state[model.b]["momentum_buffer"].clone()}
    x = torch.tensor([2.0, 3.0]) + hvd.rank()
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return {**after_broadcast, "b": model.b.detach(), "m": opt.state[model.b]["momentum_buffer"]}


# -- test_dynamic_requires_grad -----------------------------------------------------------------
def dynamic_requires_grad(impl, _sets, check_finite=None):
    """Horovod's GAN-like loop (it diverges to NaN/Inf in a few steps, on plain Horovod too): ours
    with the check off passes the NaN on and keeps its residuals finite; with it on every rank
    raises at the step the gradients first go non-finite. ``check_finite=None`` leaves the method's
    default: off for ``none`` (no residual: as Horovod), on for RedSync (it keeps one)."""
    torch.manual_seed(2)
    gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
    hvd.broadcast_parameters({**{f"gen.{n}": p for n, p in gen.state_dict().items()},
                              **{f"disc.{n}": p for n, p in disc.state_dict().items()}}, root_rank=0)
    inp = torch.rand([1, 1, 100, 100], generator=torch.Generator().manual_seed(hvd.rank()))
    extra = {} if impl == "horovod" or check_finite is None else {"compression": {"check_finite": check_finite}}
    gen_opt = wrap(impl, torch.optim.SGD(gen.parameters(), lr=0.1), gen.named_parameters(), **extra)
    disc_opt = wrap(impl, torch.optim.SGD(disc.parameters(), lr=0.1), disc.named_parameters(), **extra)

    def train_step(train_generator=False, train_discriminator=False):
        for p in gen.parameters():
            p.requires_grad_(train_generator)
        for p in disc.parameters():
            p.requires_grad_(train_discriminator)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        loss = disc(gen(inp)).sum()
        loss.backward()
        for p in gen.parameters():
            assert train_generator == (p.grad is not None and p.grad.max().is_nonzero()), \
                'Gradient for generator is zero but it should be trained or vice versa.'
        for p in disc.parameters():
            assert train_discriminator == (p.grad is not None and p.grad.max().is_nonzero()), \
                'Gradient for discriminator is zero but it should be trained or vice versa.'
        if train_generator:
            gen_opt.step()
        if train_discriminator:
            disc_opt.step()

    history = []
    for step in range(20):
        try:
            train_step(train_generator=step % 2 == 0, train_discriminator=step % 2 == 1)
        except NonFiniteGradientError as exc:
            assert check_finite or (check_finite is None and impl == "redsync"), f"{impl} raised with the check off"
            assert "on by default where the method keeps a residual" in str(exc), exc
            return {"raised at": step, "weights": [p.detach().clone() for p in [*gen.parameters(), *disc.parameters()]]}
        history.append(torch.cat([p.detach().reshape(-1) for p in [*gen.parameters(), *disc.parameters()]]))
    if impl == "redsync":
        for opt in (gen_opt, disc_opt):
            residuals = opt.exchange.memory.residual.values()
            assert residuals and all(torch.isfinite(r).all() for r in residuals), "a residual is not finite"
    return {"history": torch.stack(history)}


def check_dynamic(ours: dict, theirs: dict, impl: str) -> int:
    """Equal to plain Horovod until its first non-finite step; from there as ``check_passed_on``
    (``none``: equal throughout, NaN where Horovod's NaN are). Returns that first step."""
    h, o = theirs["history"], ours["history"]
    bad = (~torch.isfinite(h)).any(dim=1)
    first = int(bad.nonzero()[0]) if bad.any() else len(h)
    assert 0 < first < len(h), f"Horovod's loop did not go non-finite within {len(h)} steps (first: {first})"
    check({"finite steps": o[:first]}, {"finite steps": h[:first]}, impl, "dynamic_requires_grad")
    (check if impl == "none" else check_passed_on)(ours, theirs, impl, "dynamic_requires_grad")
    return first


# -- test_optimizer_process_sets -----------------------------------------------------------------
def optimizer_process_sets(impl, sets):
    """Horovod's case (every rank passes the even set: odd ranks train alone), then each rank with
    its own set (two independent groups)."""
    even_set, odd_set = sets
    this_set = even_set if hvd.rank() % 2 == 0 else odd_set
    out = {}
    for label, process_set in (("even", even_set), ("own", this_set)):
        torch.manual_seed(hvd.rank())
        x, y = torch.randn(64, 100), torch.randn(64, 10)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10))
        opt = wrap(impl, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.1),
                   model.named_parameters(), process_set=process_set)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()
        v = model.state_dict()["2.weight"]
        all_v = hvd.allgather(v, process_set=this_set).view(-1, v.numel())
        averaged = process_set is this_set or this_set is even_set
        for r, other in enumerate(all_v):
            if averaged:
                assert torch.equal(other, v.flatten()), f"{label}: rank {r} of the set differs"
            elif r != this_set.rank():
                assert not torch.allclose(other, v.flatten()), f"{label}: an odd rank trained with another"
        out[label] = v.clone()
    return out


# -- test_sparse_embeddings ------------------------------------------------------------------------
def sparse_embeddings(impl, _sets, nan_step=None, check_finite=True):
    """Horovod's case, three steps and for both sparse_as_dense; ``nan_step``: rank 1's loss is NaN
    at that step (ours raises on every rank with check_finite, or passes it on as Horovod)."""
    out = {}
    for sparse_as_dense in (False, True):
        torch.manual_seed(3)
        model = torch.nn.Embedding(10, 3, sparse=True)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        inp = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]] if hvd.rank() == 0 else [[1, 3, 4], [4, 7, 9]])
        extra = {} if impl == "horovod" else {"compression": {"check_finite": check_finite}}
        opt = wrap(impl, torch.optim.SparseAdam(list(model.parameters()), lr=0.1), sparse_as_dense=sparse_as_dense,
                   **extra)
        for step in range(3):
            loss = model(inp).sum()
            if step == nan_step and hvd.rank() == 1:
                loss = loss * float("nan")
            opt.zero_grad()
            loss.backward()
            before = model.weight.detach().clone()
            try:
                opt.step()
            except NonFiniteGradientError:
                assert check_finite and step == nan_step, f"raised at step {step}"
                assert torch.equal(model.weight, before), "a failed step changed the weights"
                out[f"raised {sparse_as_dense}"] = torch.tensor(step)
        if impl != "horovod":   # rows beside the exchange (8-byte index, 3 values a row), or dense inside it
            assert ("param.0" in opt.exchange.layers) == sparse_as_dense
            wire = opt.communication_stats()["layers"]["param.0"]["wire_bytes"]
            assert wire == (4 * 30 if sparse_as_dense and impl == "none" else 20 * inp.numel()
                            if not sparse_as_dense else wire), wire
        state = opt.state[model.weight]
        out.update({f"weight {sparse_as_dense}": model.weight.detach(),
                    f"exp_avg {sparse_as_dense}": state["exp_avg"].to_dense(),
                    f"exp_avg_sq {sparse_as_dense}": state["exp_avg_sq"].to_dense()})
    return out


# -- test_synchronize_step_warning -----------------------------------------------------------------
def synchronize_step_warning(impl, _sets):
    x, y = torch.zeros(1, 1) + hvd.rank(), torch.ones(1, 1)
    torch.manual_seed(4)
    model = torch.nn.Linear(1, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = wrap(impl, torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    loss = F.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("module")
        optimizer.step()
        assert len(ws) == 1, [str(w.message) for w in ws]
        assert 'optimizer.step() called without optimizer.skip_synchronize()' in str(ws[0].message)
    return {"weight": model.weight.detach(), "bias": model.bias.detach()}


# -- horovod.torch's keywords: op, gradient_predivide_factor, groups, set_backward_passes_per_step ---
KEYWORDS = {"op=Sum": {"op": hvd.Sum}, "gradient_predivide_factor=0.3": {"gradient_predivide_factor": 0.3},
            "groups=2": {"groups": 2}, "groups=[[fc1]]": {"groups": "fc1"}, "backward_passes_per_step=2": {}}


def keywords(impl, _sets):
    out = {}
    for label, kw in KEYWORDS.items():
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if kw.get("groups") == "fc1":
            kw = {"groups": [list(model[0].parameters())]}
        opt = wrap(impl, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5), model.named_parameters(), **kw)
        passes = 2 if label.startswith("backward") else 1
        opt.set_backward_passes_per_step(passes)
        gen = torch.Generator().manual_seed(hvd.rank())
        for _ in range(3):
            opt.zero_grad()
            for _ in range(passes):
                x = torch.randn(8, 20, generator=gen)
                model(x).pow(2).mean().backward()
            opt.step()
        if impl != "horovod" and label == "groups=2":
            assert len(opt.exchange.buckets) == 2, opt.exchange.buckets
        # test_optimizer_no_named_parameters: names unique, the same on every rank
        names = opt._parameter_names.values()
        assert len(set(names)) == len(names) and len(set(map(tuple, hvd.allgather_object(sorted(names))))) == 1
        out.update({f"{label} {n}": p.detach() for n, p in model.named_parameters()})
    return out


CASES = {"broadcast_state_no_grad": broadcast_state_no_grad, "dynamic_requires_grad": dynamic_requires_grad,
         "optimizer_process_sets": optimizer_process_sets, "sparse_embeddings": sparse_embeddings,
         "synchronize_step_warning": synchronize_step_warning, "keywords": keywords}


def main():
    hvd.init()
    rank = hvd.rank()
    sets = (hvd.add_process_set(list(range(0, hvd.size(), 2))), hvd.add_process_set(list(range(1, hvd.size(), 2))))
    for case, run in CASES.items():
        theirs = run("horovod", sets)
        for impl in ("none", "redsync"):
            ours = run(impl, sets)
            if case == "dynamic_requires_grad":   # none's default passes NaN on; RedSync's raises
                if impl == "redsync":
                    raised, ours = ours, run(impl, sets, check_finite=False)
                else:
                    raised = run(impl, sets, check_finite=True)
                first = check_dynamic(ours, theirs, impl)
                assert raised["raised at"] == first, f"raised at step {raised['raised at']}, first NaN at {first}"
            else:
                check(ours, theirs, impl, case)
            print(f"rank {rank}: OK {case} {impl}", flush=True)
    # sparse rows with NaN on one rank: passed on as Horovod does (check off), or every rank raises
    theirs = sparse_embeddings("horovod", sets, nan_step=1)
    for impl in ("none", "redsync"):
        ours = sparse_embeddings(impl, sets, nan_step=1, check_finite=False)
        rows = {k: v for k, v in theirs.items() if k.endswith("False")}   # beside the exchange: Horovod's rows
        check(ours, rows if impl == "redsync" else theirs, impl, "sparse NaN")
        check_passed_on(ours, theirs, impl, "sparse NaN")
        raised = sparse_embeddings(impl, sets, nan_step=1, check_finite=True)
        assert raised["raised False"] == 1 and raised["raised True"] == 1, raised
        print(f"rank {rank}: OK sparse_nan {impl}", flush=True)
    print(f"rank {rank}: OK hvd_api", flush=True)


if __name__ == "__main__":
    main()
