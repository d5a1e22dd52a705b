"""A dropped DistributedOptimizer is freed, and the model it wrapped trains on under a new one.

The gradient hooks live in autograd's C++ side of each parameter, where the garbage collector
cannot follow them: a hook that held its optimizer kept every optimizer a process made (its
exchange buffers, residuals and moments) alive, as a benchmark or a sweep that trains many runs
in one process does. Per method: train, drop the optimizer, check that it is gone, then check
that a second optimizer on the same model is the only one its hooks reach (each parameter has one
hook, and the new optimizer's step moves every parameter)."""
import gc
import sys
import weakref

import torch

import redsync_hvd.torch as rhvd


def train(model, opt, steps=2):
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rhvd.rank()))
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def main(method: str) -> None:
    compression = {"method": method} if method != "redsync" else {"method": "redsync", "local_steps": 1}
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), compression=compression)
    train(model, opt)
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert gone() is None, f"{method}: the dropped optimizer is still alive: {gc.get_referrers(gone())[:3]}"
    hooks = {n: len(p._post_accumulate_grad_hooks or {}) for n, p in model.named_parameters()}
    assert set(hooks.values()) == {0}, f"{method}: the dropped optimizer's hooks stayed: {hooks}"
    again = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                      named_parameters=model.named_parameters(), compression=compression)
    hooks = {n: len(p._post_accumulate_grad_hooks) for n, p in model.named_parameters()}
    assert set(hooks.values()) == {1}, f"{method}: each parameter should have the new optimizer's hook: {hooks}"
    before = [p.detach().clone() for p in model.parameters()]
    train(model, again, steps=1)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters())), f"{method}: no step was taken"
    print(f"rank {rhvd.rank()}: OK dropped optimizer {method}", flush=True)


if __name__ == "__main__":
    rhvd.init()
    for m in sys.argv[1:] or ["none", "redsync"]:
        main(m)
