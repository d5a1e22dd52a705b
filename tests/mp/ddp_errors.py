"""Under torchrun (Gloo), failures are errors on every rank, never hangs:
1. ranks with different compression configs: register() raises everywhere;
2. a NaN gradient on rank 1 at step 1, with top-k and with none's fast path (check_finite set):
   backward() raises on both ranks, residuals are left as they were, and the next step trains
   normally; none without check_finite averages the NaN into every rank's gradient, as DDP."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from redsync_hvd.launchers import close_process_group
from redsync_hvd.torch import ddp as rddp


def model_and_opt():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(30, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0.005)
    return model, ddp, torch.optim.SGD(ddp.parameters(), lr=0.05)


def config_mismatch(rank):
    _, ddp, _ = model_and_opt()
    try:
        rddp.register(ddp, {"method": "topk", "density": 0.01 * (rank + 1)})
    except ValueError as exc:
        assert "different compression config" in str(exc), exc
        return
    raise AssertionError("ranks with different configs were not refused")


def nan_on_one_rank(rank, compression):
    model, ddp, opt = model_and_opt()
    state = rddp.register(ddp, compression)
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(3):
        x, y = torch.randn(8, 30), torch.randint(0, 4, (8,))
        if step == 1 and rank == 1:
            x[0, 0] = float("nan")
        memory = state.exchange.residuals() if state.exchange is not None else {}
        before = {k: v.clone() for k, v in memory.items()}
        opt.zero_grad()
        try:
            lossf(ddp(x), y).backward()
        except Exception as exc:   # the future's error, as DDP raises it
            assert step == 1 and "non-finite gradient" in str(exc), (step, exc)
            assert all(torch.equal(before[k], memory[k]) for k in before), "residuals changed on a failed step"
            print(f"rank {rank}: raised at step {step} ({compression['method']})")
            continue
        assert step != 1, "the NaN step did not raise"
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if state.exchange is not None:   # the fast path counts bytes as it starts the allreduce
        assert state.communication_stats()["steps"] == 2


def nan_reaches_every_rank_alike(rank):
    """none's fast path without an explicit check_finite is DDP: the NaN is in every rank's average."""
    model, ddp, opt = model_and_opt()
    rddp.register(ddp, {"method": "none"})
    x, y = torch.randn(8, 30), torch.randint(0, 4, (8,))
    if rank == 1:
        x[0, 0] = float("nan")
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    assert all(torch.isnan(p.grad).any() for p in model.parameters()), "the NaN did not reach this rank"
    print(f"rank {rank}: NaN averaged as DDP does")


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config_mismatch(rank)
    nan_on_one_rank(rank, {"method": "topk", "density": 0.1})
    nan_on_one_rank(rank, {"method": "none", "check_finite": True})
    nan_reaches_every_rank_alike(rank)
    print(f"rank {rank}: OK errors")
    close_process_group()


if __name__ == "__main__":
    main()
