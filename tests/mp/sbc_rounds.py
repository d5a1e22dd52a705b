"""Local steps under horovodrun (SBC, and ``local_steps`` of RedSync and top-k, set or auto): after every
communication round all ranks hold identical models, no collective runs between rounds,
local_steps=1/density=1/no binarisation equals dense SGD, and at density 1 with fp32 values a
round lands on the average of the workers' own local SGD runs (``check_local``), or with
``outer_momentum``/``outer_lr`` on DiLoCo's outer Nesterov step from it."""
import copy
import json
import sys

import torch

import redsync_hvd.torch as rhvd


def main(options):
    options = dict(options)
    check_dense = options.pop("check_dense", False)
    check_local = options.pop("check_local", False)
    method = options.pop("method", "sbc")
    expect_steps = options.pop("expect_steps", None)   # local_steps: auto settles to this
    sync_last = options.pop("sync_last", False)   # sync_next_step() before the last step: a round there too
    check_decay = options.get("local_decay")   # SparseLoCo's decay: what each rank sent, from its residuals
    mu, outer_lr = options.get("outer_momentum", 0.0), options.get("outer_lr", 1.0)   # DiLoCo's outer step
    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
    ref = copy.deepcopy(model)
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression={"method": method, **options})
    rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    X, Y = torch.randn(12, size, 8, 20), torch.randint(0, 5, (12, size, 8))
    lossf = torch.nn.CrossEntropyLoss()
    n = expect_steps or options["local_steps"]
    assert opt.compression_config.local_steps == n, opt.compression_config.local_steps
    if options["local_steps"] == "auto":
        assert any(f"local_steps: {n} (auto)" in note for note in opt._exchange.policy.notes), \
            opt._exchange.policy.notes
    local = [copy.deepcopy(ref) for _ in range(size)]   # each worker's own SGD since the last round
    names = [n for n, _ in model.named_parameters()]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}   # the common weights of the last round
    kept = {n: torch.zeros_like(p) for n, p in before.items()}             # this rank's residuals then
    start = [p.detach().clone() for p in model.parameters()]               # the round's common weights
    buf = [torch.zeros_like(p) for p in start]                             # the outer momentum, by hand
    for step in range(12):
        for r, m in enumerate(local):
            m.zero_grad()
            lossf(m(X[step, r]), Y[step, r]).backward()
            with torch.no_grad():
                for q in m.parameters():
                    q -= 0.1 * q.grad
        opt.zero_grad()
        lossf(model(X[step, rank]), Y[step, rank]).backward()
        last = sync_last and step == 11
        if last:
            opt.sync_next_step()
        wire_before = opt.communication_stats()["wire_bytes"]
        opt.step()
        wire_after = opt.communication_stats()["wire_bytes"]
        if (step + 1) % n and not last:
            assert wire_after == wire_before, "a collective ran between communication rounds"
            continue
        everyone = rhvd.allgather_object([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for other in everyone for a, b in zip(other, everyone[0])), \
            f"models differ after round at step {step}"
        if check_local:
            with torch.no_grad():
                average = [torch.stack(qs).mean(0) for qs in zip(*(m.parameters() for m in local))]
            for i, (p, a) in enumerate(zip(model.parameters(), average)):
                delta = a - start[i]
                buf[i] = mu * buf[i] + delta
                expect = start[i] + outer_lr * (delta + mu * buf[i])
                assert torch.allclose(p, expect, atol=1e-5), (p - expect).abs().max()
                if mu or outer_lr != 1.0:
                    assert not torch.allclose(p, a, atol=1e-4), "the outer step did not move the weights"
            start = [p.detach().clone() for p in model.parameters()]
        if check_decay:
            check_sent(opt, model, local[rank], names, before, kept, check_decay)
        local = [copy.deepcopy(model) for _ in range(size)]
        if check_dense:
            ref_opt.zero_grad()
            (sum(lossf(ref(X[step, r]), Y[step, r]) for r in range(size)) / size).backward()
            ref_opt.step()
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.allclose(p, q, atol=1e-5), (p - q).abs().max()
    s = opt.communication_stats()
    assert s["steps"] == 12 and s["dense_bytes"] == 12 * 4 * sum(p.numel() for p in model.parameters()), s
    print(f"rank {rank}: OK sbc {method} {options} ratio={s['compression_ratio']:.1f}")


def check_sent(opt, model, mine, names, before, kept, decay):
    """SparseLoCo's x = decay * r + delta: what each rank sent is x - r_now; their mean must be
    the step the common weights took. Fails if the decay is not applied (r_then is not zero)."""
    now = {n: r.view(before[n].shape) for n, r in opt._exchange.memory.residuals().items()}
    own = dict(zip(names, mine.parameters()))
    with torch.no_grad():
        sent = [decay * kept[n] + (own[n] - before[n]) - now[n] for n in names]
    everyone = rhvd.allgather_object(sent)
    for n, p, *theirs in zip(names, model.parameters(), *everyone):
        step = p.detach() - before[n]
        mean = torch.stack(theirs).mean(0)
        assert torch.allclose(step, mean, atol=1e-5), (n, (step - mean).abs().max())
        before[n], kept[n] = p.detach().clone(), now[n].clone()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
