"""Error feedback in update units under AdamW, two workers, checked against a reference computed here:
``horovodrun -np 2 python update_units.py horovod`` or ``torchrun --nproc_per_node 2 update_units.py ddp``.

1. At density 1 the compressed layer (5,120 weights) moves by the average of each worker's own AdamW
   direction (each from its own moments), plus the decoupled decay; the dense layers (biases, the
   192-weight head) by the optimizer's own AdamW on the averaged gradient. The same run differs from
   dense AdamW on the compressed layer.
2. At density 0.05 a run saved after 3 steps and resumed into a new model and optimizer ends 6 steps
   bit-identical to the run that went on: the moments, step counts and residuals are in the state.
3. ``adam_variance: of_average``: (1) again, each direction divided by sqrt(v_hat/N + (1-1/N) m_hat**2)
   + eps; under Horovod also with 2 local steps at density 1, where every layer's local AdamW step
   is so divided and the weights move by the average delta after each round; and ``shared``, where
   after each exchange every worker divides by the workers' estimates averaged, the same on every rank,
   and ``shared_factored``, where a matrix's shared estimate is rebuilt from its row and column means.
Prints ``OK <check>`` per check on every rank."""
import copy
import sys

import torch

ENGINE = sys.argv[1]
SPEC = {"method": "topk", "density": 1.0, "feedback_units": "update", "policy": {"min_compress_numel": 4096}}
LR, BETAS, WD, EPS = 0.01, (0.9, 0.95), 0.1, 1e-8


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 80), torch.nn.Tanh(), torch.nn.Linear(80, 3))


def batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 64, generator=gen), torch.randint(0, 3, (16,), generator=gen)


def loss_of(model, step, rank):
    x, y = batch(step, rank)
    return torch.nn.functional.cross_entropy(model(x), y)


if ENGINE == "horovod":
    import horovod.torch as hvd

    from redsync_hvd.torch import DistributedOptimizer
    hvd.init()
    RANK, SIZE = hvd.rank(), hvd.size()

    def wrap(model, spec):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)
        opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=spec)
        return model, opt, opt   # the Horovod optimizer's state_dict holds the exchange's ("redsync")
else:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from redsync_hvd.torch.ddp import register
    dist.init_process_group("gloo")
    RANK, SIZE = dist.get_rank(), dist.get_world_size()

    def wrap(model, spec):
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)
        return ddp, opt, register(ddp, spec, optimizer=opt)


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, step, RANK).backward()
        opt.step()


def denominator(m, v, t, of_average):
    v_hat, m_hat = v / (1 - BETAS[1] ** t), m / (1 - BETAS[0] ** t)
    if of_average:   # the second moment of the average of SIZE workers' gradients
        return (v_hat / SIZE + (1 - 1 / SIZE) * m_hat ** 2).sqrt() + EPS
    return (v.sqrt() / (1 - BETAS[1] ** t) ** 0.5).add_(EPS)


def reference(steps, of_average=False):
    """Every worker's own AdamW direction on the compressed weight, averaged; AdamW on the rest."""
    model = net()
    big = model[0].weight
    rest = [p for p in model.parameters() if p is not big]
    dense = torch.optim.AdamW(rest, lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)
    moments = [(torch.zeros_like(big), torch.zeros_like(big)) for _ in range(SIZE)]
    for step in range(steps):
        grads = []
        for r in range(SIZE):
            model.zero_grad()
            loss_of(model, step, r).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        t, directions = step + 1, []
        for r, (m, v) in enumerate(moments):
            g = grads[r][0]
            m.lerp_(g, 1 - BETAS[0])
            v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            denom = denominator(m, v, t, of_average)
            directions.append(m / (1 - BETAS[0] ** t) / denom)
        for i, p in enumerate(rest, start=1):
            p.grad = sum(g[i] for g in grads) / SIZE
        dense.step()
        with torch.no_grad():
            big.mul_(1 - LR * WD).sub_(LR * sum(directions) / SIZE)
    return model


def factored(e):
    """Adafactor's rebuild of a matrix from its row and column means; vectors as they are."""
    return torch.outer(e.mean(1), e.mean(0)) / e.mean() if e.dim() == 2 else e


def local_reference(steps, local, shared=False, factor=False):
    """Each worker ``local`` AdamW steps of its own, divided by the average's variance, from the
    round's weights; then every weight moves by the average delta. ``shared``: from the first
    exchange on, every worker divides by the mean over the workers of their estimates
    v_hat/N + (1-1/N) m_hat**2 taken at the last exchange, or by its own estimate now / N where
    that is larger."""
    start = net()
    workers = [copy.deepcopy(start) for _ in range(SIZE)]
    moments = [{i: (torch.zeros_like(p), torch.zeros_like(p)) for i, p in enumerate(w.parameters())} for w in workers]
    common = {}
    for step in range(steps):
        for r, w in enumerate(workers):
            w.zero_grad()
            loss_of(w, step, r).backward()
            with torch.no_grad():
                for i, p in enumerate(w.parameters()):
                    m, v = moments[r][i]
                    m.lerp_(p.grad, 1 - BETAS[0])
                    v.mul_(BETAS[1]).addcmul_(p.grad, p.grad, value=1 - BETAS[1])
                    denom = denominator(m, v, step + 1, True)
                    if i in common:   # the shared variance, or this worker's estimate / N where larger
                        denom = torch.maximum(common[i], ((denom - EPS) ** 2) / SIZE).sqrt() + EPS
                    p.mul_(1 - LR * WD).sub_(LR * m / (1 - BETAS[0] ** (step + 1)) / denom)
        if (step + 1) % local == 0:
            with torch.no_grad():
                for p0, *got in zip(start.parameters(), *(w.parameters() for w in workers)):
                    p0.add_(sum(q - p0 for q in got) / SIZE)
                    for q in got:
                        q.copy_(p0)
                if shared:
                    common = {i: sum((denominator(*moments[r][i], step + 1, True) - EPS) ** 2
                                     for r in range(SIZE)) / SIZE for i in moments[0]}
                    common = {i: factored(e) if factor else e for i, e in common.items()}
    return start


def dense_adamw(steps):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, eps=EPS)
    for step in range(steps):
        model.zero_grad()
        sum(loss_of(model, step, r) for r in range(SIZE)).div(SIZE).backward()
        opt.step()
    return model


def params(model):
    return [p.detach() for p in model.parameters()]


# 1. density 1: the average of the workers' own AdamW steps
model, opt, _ = wrap(net(), SPEC)
train(model, opt, 5)
ref, dense = params(reference(5)), params(dense_adamw(5))
mine = params(model)
for a, b in zip(mine, ref):
    assert torch.allclose(a, b, rtol=0, atol=2e-6), (a.shape, (a - b).abs().max())
assert (mine[0] - dense[0]).abs().max() > 1e-4, "update units moved the compressed layer as dense AdamW does"
for a, b in zip(mine[1:], dense[1:]):   # the dense layers' average gradient differs: only closeness
    assert torch.isfinite(a).all() and a.shape == b.shape
print("OK density 1 equals the workers' own AdamW steps averaged", flush=True)

# 2. a resume between steps 3 and 4 ends bit-identical
SPARSE = {**SPEC, "density": 0.05}
model, opt, hold = wrap(net(), SPARSE)
train(model, opt, 3)
saved = [copy.deepcopy(x.state_dict()) for x in (model, opt, hold)]
train(model, opt, 3, start=3)
again = wrap(net(), SPARSE)
for x, s in zip(again, saved):
    x.load_state_dict(s)
train(*again[:2], 3, start=3)
assert all(torch.equal(a, b) for a, b in zip(params(model), params(again[0])))
state = hold.state_dict()
memory = (state["redsync"] if ENGINE == "horovod" else state["exchange"])["memory"]
name = "0.weight"   # the exchange names layers as the module does, under DDP too
assert memory["steps"] == {name: 6} and memory["exp_avg"][name].abs().sum() > 0, memory["steps"]
print("OK a resume keeps the moments bit for bit", flush=True)

# 3. adam_variance: of_average, every step and (Horovod) under local steps
model, opt, _ = wrap(net(), {**SPEC, "adam_variance": "of_average"})
train(model, opt, 5)
for a, b in zip(params(model), params(reference(5, of_average=True))):
    assert torch.allclose(a, b, rtol=0, atol=2e-6), (a.shape, (a - b).abs().max())
assert (params(model)[0] - params(reference(5))[0]).abs().max() > 1e-5, "of_average moved as own variance does"
if ENGINE == "horovod":
    local = {"method": "topk", "density": 1.0, "local_steps": 2, "adam_variance": "of_average"}
    model, opt, _ = wrap(net(), local)
    train(model, opt, 4)
    for a, b in zip(params(model), params(local_reference(4, 2))):
        assert torch.allclose(a, b, rtol=0, atol=2e-6), (a.shape, (a - b).abs().max())
    # adam_variance: shared, every worker divides by the same averaged estimate after an exchange
    model, opt, _ = wrap(net(), {**local, "adam_variance": "shared"})
    train(model, opt, 6)
    shared = [opt.state[p]["shared_var"] for p in model.parameters()]
    gathered = hvd.allgather_object([v.clone() for v in shared])
    assert all(torch.equal(a, b) for a, b in zip(*gathered)), "ranks divide by different variances"
    for a, b in zip(params(model), params(local_reference(6, 2, shared=True))):
        assert torch.allclose(a, b, rtol=0, atol=2e-6), (a.shape, (a - b).abs().max())
    assert (params(model)[0] - params(local_reference(6, 2))[0]).abs().max() > 1e-6, "shared moved as of_average"
    assert opt.exchange.stats.total.get("bytes_variance", 0) > 0, "the variance's bytes went uncounted"
    # shared_factored: a matrix's shared variance is rebuilt from its row and column means
    model, opt, _ = wrap(net(), {**local, "adam_variance": "shared_factored"})
    train(model, opt, 6)
    weight = opt.state[model[0].weight]["shared_var"]
    assert weight.shape == (80, 64) and torch.linalg.matrix_rank(weight) == 1, "not rebuilt from its means"
    for a, b in zip(params(model), params(local_reference(6, 2, shared=True, factor=True))):
        assert torch.allclose(a, b, rtol=0, atol=2e-6), (a.shape, (a - b).abs().max())
    sent = opt.exchange.stats.total["bytes_variance"]
    assert sent == 2 * 4 * (80 + 64 + 80 + 3 + 80 + 3), sent   # 2 rounds counted by step 6: rows + columns, biases
    plain = net()
    try:
        DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9),
                             named_parameters=plain.named_parameters(), compression=local)
        raise AssertionError("of_average was accepted under SGD")
    except ValueError as error:
        assert "plain Adam or AdamW" in str(error) and "SGD" in str(error), error
print("OK of_average divides by the average's variance", flush=True)
if ENGINE == "ddp":
    # launchers.close_process_group: torch's Gloo teardown at exit aborted this job once
    # ("terminate called without an active exception") after both ranks had printed OK
    from redsync_hvd.launchers import close_process_group
    close_process_group()
