"""SBC under horovodrun: after every communication round all ranks hold identical models,
no collective runs between rounds, and local_steps=1/density=1/no binarisation equals dense SGD."""
import copy
import json
import sys

import torch

import redsync_hvd.torch as rhvd


def main(options):
    options = dict(options)
    check_dense = options.pop("check_dense", False)
    rhvd.init()
    rank, size = rhvd.rank(), rhvd.size()
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
    ref = copy.deepcopy(model)
    opt = rhvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression={"method": "sbc", **options})
    rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    X, Y = torch.randn(12, size, 8, 20), torch.randint(0, 5, (12, size, 8))
    lossf = torch.nn.CrossEntropyLoss()
    n = options["local_steps"]
    for step in range(12):
        opt.zero_grad()
        lossf(model(X[step, rank]), Y[step, rank]).backward()
        wire_before = opt.communication_stats()["wire_bytes"]
        opt.step()
        wire_after = opt.communication_stats()["wire_bytes"]
        if (step + 1) % n:
            assert wire_after == wire_before, "a collective ran between communication rounds"
            continue
        everyone = rhvd.allgather_object([p.detach().clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for other in everyone for a, b in zip(other, everyone[0])), \
            f"models differ after round at step {step}"
        if check_dense:
            ref_opt.zero_grad()
            (sum(lossf(ref(X[step, r]), Y[step, r]) for r in range(size)) / size).backward()
            ref_opt.step()
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.allclose(p, q, atol=1e-5), (p - q).abs().max()
    s = opt.communication_stats()
    assert s["steps"] == 12 and s["dense_bytes"] == 12 * 4 * sum(p.numel() for p in model.parameters()), s
    print(f"rank {rank}: OK sbc {options} ratio={s['compression_ratio']:.1f}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
