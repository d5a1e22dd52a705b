"""The YAML runner's PyTorch side: model, optimizer and one training step (runner.py owns the loop)."""
from __future__ import annotations

import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, default_collate

from ..config import RunConfig
from ..models import build_model
from ..runner import lr_factor


def loss_and_correct(model, x, y, task):
    out = model(x)
    if task == "lm":
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    loss = F.cross_entropy(out, y)
    return loss, (out.argmax(-1) == y).sum().item(), y.numel()


def build_optimizer(cfg: RunConfig, model, size):
    o = cfg.optimizer
    lr = o.lr * (size if o.scale_lr_by_workers else 1)
    if o.name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=o.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=o.momentum, nesterov=o.nesterov,
                           weight_decay=o.weight_decay)


class HorovodAdapter:
    """Start-up of a PyTorch process under horovodrun."""
    framework = "torch"

    def __init__(self):
        import redsync_hvd.torch as rhvd
        self.rhvd = rhvd

    def init(self, cfg: RunConfig) -> tuple:
        self.rhvd.init()
        # workers sharing a host split its cores; oversubscribed intra-op threads thrash
        torch.set_num_threads(cfg.training.threads or max(1, (os.cpu_count() or 1) // self.rhvd.local_size()))
        return self.rhvd.rank(), self.rhvd.size()

    def allgather_object(self, obj, name: str):
        return self.rhvd.allgather_object(obj, name=name)

    def trainer(self, cfg: RunConfig, data, rank: int, size: int) -> "TorchTrainer":
        return TorchTrainer(cfg, data, rank, size, self.rhvd)


class TorchTrainer:
    framework = "torch"

    def __init__(self, cfg: RunConfig, data, rank: int, size: int, rhvd):
        self.cfg, self.data, self.rank, self.size, self.rhvd = cfg, data, rank, size, rhvd
        self.task, self.train_size = data.task, len(data.train)
        self.model = build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options)
        base = build_optimizer(cfg, self.model, size)
        self.lr0 = base.param_groups[0]["lr"]   # scaled for this run's workers
        self.opt = rhvd.DistributedOptimizer(base, named_parameters=self.model.named_parameters(),
                                             compression=cfg.compression.model_dump())
        rhvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        rhvd.broadcast_optimizer_state(self.opt, root_rank=0)
        self.sched = None

    def set_steps_per_epoch(self, steps: int) -> None:
        self.opt.set_steps_per_epoch(steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_factor(self.cfg, steps))

    def _batch(self, indices: torch.Tensor):
        ds = self.data.train
        items = ds.__getitems__(indices.tolist()) if hasattr(ds, "__getitems__") else [ds[i] for i in indices.tolist()]
        return default_collate(items)

    def step(self, indices: torch.Tensor, step: int) -> tuple:
        x, y = self._batch(indices)
        loss, correct, n = loss_and_correct(self.model, x, y, self.task)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss.item(), correct, n

    def lr(self, step: int) -> float:
        return self.sched.get_last_lr()[0]

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Each rank scores its slice of the test set; sums are allreduced (counted apart from
        training bytes). Decentralized workers hold different models: their average is scored."""
        averaged = self.opt.averaged_parameters() if hasattr(self.opt, "averaged_parameters") else nullcontext()
        with averaged:
            result = self._score()
        if hasattr(self.opt, "consensus_distance"):
            result["consensus_distance"] = self.opt.consensus_distance()
        return result

    def _score(self) -> dict:
        self.model.eval()
        test = self.data.test
        loader = DataLoader(Subset(test, list(range(self.rank, len(test), self.size))),
                            batch_size=max(256, self.cfg.training.batch_size))
        tot = torch.zeros(3, dtype=torch.float64)
        for x, y in loader:
            loss, correct, n = loss_and_correct(self.model, x, y, self.task)
            tot += torch.tensor([loss.item() * n, correct, n], dtype=torch.float64)
        tot = self.rhvd.allreduce(tot, op=self.rhvd.Sum, name="rsync.eval")
        self.model.train()
        return {"test_loss": tot[0].item() / max(1, tot[2].item()),
                "test_accuracy": tot[1].item() / max(1, tot[2].item())}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The saved state, with the learning rate of this run: a checkpoint of M workers under
        ``scale_lr_by_workers`` carries lr * M, and this run has N (the same value otherwise)."""
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.sched.base_lrs = [self.lr0] * len(self.opt.param_groups)
        for group, factor in zip(self.opt.param_groups, self.sched.lr_lambdas):
            group["initial_lr"], group["lr"] = self.lr0, self.lr0 * factor(self.sched.last_epoch)

    def communication_stats(self) -> dict:
        return self.opt.communication_stats()

    def layer_decisions(self) -> list:
        return self.opt.layer_decisions()

    def decision_record(self) -> dict:
        exchange = self.carrier()
        return exchange.decision_record() if exchange is not None else {"source": "none", "layers": []}

    def carrier(self):
        """The GradientExchange whose per-step allreduce can carry the runner's flags (None: none)."""
        return getattr(self.opt, "exchange", None)
