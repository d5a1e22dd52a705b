"""The YAML runner's PyTorch side: model, optimizer and one training step (runner.py owns the loop).

One trainer, three engines (``engine:`` in the config), each an adapter that starts the process
and says how gradients travel:

- :class:`HorovodAdapter` (``engine: horovod``, under horovodrun): the optimizer is wrapped by
  :func:`redsync_hvd.torch.DistributedOptimizer`;
- :class:`DDPAdapter` (``engine: ddp``, under torchrun): torch.distributed (Gloo on CPU, NCCL
  on CUDA), the model in ``DistributedDataParallel`` with :func:`redsync_hvd.torch.ddp.register`'s
  communication hook;
- :class:`FSDPAdapter` (``engine: fsdp``, under torchrun): the model sharded by FSDP2's
  ``fully_shard`` (every module holding parameters, then the model), its reduce-scatters
  compressed by :func:`redsync_hvd.torch.fsdp.register`.

``training.precision`` runs forward and backward under ``torch.autocast`` (bf16 or fp16;
parameters and the update stay fp32); fp16 adds a ``torch.amp.GradScaler``, handed to the
exchange (``set_grad_scaler``) so residuals keep unscaled values and an overflowing step
leaves them untouched.
"""
from __future__ import annotations

import atexit
import os
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset, default_collate

from ..config import RunConfig
from ..models import build_model
from ..schedule import lr_factor, total_steps
from . import ddp as rddp
from . import fsdp as rfsdp

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def loss_and_correct(model, x, y, task):
    out = model(x)
    if task == "lm":
        out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
    loss = F.cross_entropy(out, y)
    return loss, (out.argmax(-1) == y).sum().item(), y.numel()


NORMS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm, torch.nn.modules.batchnorm._NormBase)


def compression_of(cfg: RunConfig) -> dict:
    """The config's ``compression`` section for the adapters that take local steps: under
    ``training.precision: fp16`` ``local_steps: auto`` is every step, since a GradScaler skips
    an overflowing step on one rank only (``set_grad_scaler``)."""
    compression = cfg.compression.model_dump()
    if cfg.training.precision == "fp16" and compression.get("local_steps") == "auto":
        compression["local_steps"] = 1
    return compression


def build_optimizer(cfg: RunConfig, model, size):
    o = cfg.optimizer
    lr = o.lr * (size if o.scale_lr_by_workers else 1)
    groups = param_groups(model, o.no_decay)
    if o.name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return torch.optim.SGD(groups, lr=lr, momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay)


def param_groups(model, no_decay) -> list:
    """``model.parameters()``, or with ``optimizer.no_decay`` two groups: the rest, and those
    exempt from weight decay (by module type: a module's ``bias``, norms' weights, embeddings).
    A parameter shared by two modules (a tied output layer) is counted once, by its first module."""
    if not no_decay:
        return list(model.parameters())
    exempt: dict = {}
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            if ("bias" in no_decay and attr == "bias") or ("norm" in no_decay and isinstance(module, NORMS)) \
                    or ("embedding" in no_decay and isinstance(module, torch.nn.Embedding)):
                exempt[id(p)] = p
    rest = [p for p in model.parameters() if id(p) not in exempt]
    groups = [{"params": rest}] if rest else []
    if exempt:
        groups.append({"params": list(exempt.values()), "weight_decay": 0.0})
    return groups


def autocast(precision: str, device: torch.device):
    """Forward (and so backward) in ``precision``; fp32: no autocast at all."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def _threads(cfg: RunConfig, local_workers: int) -> None:
    # workers sharing a host split its cores; oversubscribed intra-op threads thrash
    torch.set_num_threads(cfg.training.threads or max(1, (os.cpu_count() or 1) // max(1, local_workers)))


class _Unsharded:
    """What a checkpoint holds of the model and the optimizer: their state dicts as they are."""

    def save_states(self, model, opt) -> tuple:
        return model.state_dict(), opt.state_dict()

    def load_states(self, model, opt, model_state: dict, opt_state: dict) -> None:
        model.load_state_dict(model_state)
        opt.load_state_dict(opt_state)

    def eval_batches(self, loader) -> int:
        """How many batches every rank runs in evaluation (its own: no collective in a forward)."""
        return len(loader)


class HorovodAdapter(_Unsharded):
    """Start-up of a PyTorch process under horovodrun (``engine: horovod``)."""
    framework, engine = "torch", "horovod"

    def __init__(self):
        import redsync_hvd.torch as rhvd
        self.rhvd = rhvd
        self.device = torch.device("cpu")

    def init(self, cfg: RunConfig) -> tuple:
        self.rhvd.init()
        _threads(cfg, self.rhvd.local_size())
        return self.rhvd.rank(), self.rhvd.size()

    def allgather_object(self, obj, name: str):
        return self.rhvd.allgather_object(obj, name=name)

    def trainer(self, cfg: RunConfig, data, rank: int, size: int) -> "TorchTrainer":
        return TorchTrainer(cfg, data, rank, size, self)

    def distribute(self, cfg: RunConfig, model, opt, total: int | None = None) -> tuple:
        """(module the forward runs through, optimizer that steps, what counts the communication);
        ``total``: the run's steps (``local_steps: auto`` reads it under Adam)."""
        opt = self.rhvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                             compression=compression_of(cfg), total_steps=total)
        self.rhvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.rhvd.broadcast_optimizer_state(opt, root_rank=0, initialize=False)   # no step before the first
        return model, opt, opt

    def optimizer_step(self, opt, scaler) -> None:
        if not scaler.is_enabled():
            opt.step()
            return
        opt.synchronize()   # the averages reach .grad before the scaler unscales and checks them
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.rhvd.allreduce(tensor, op=self.rhvd.Sum, name="rsync.eval")


class DDPAdapter(_Unsharded):
    """Start-up of a PyTorch process under torchrun (``engine: ddp``): torch.distributed."""
    framework, engine = "torch", "ddp"

    def __init__(self):
        self.device = torch.device("cpu")

    def init(self, cfg: RunConfig) -> tuple:
        """1. the device: ``cuda:LOCAL_RANK`` where CUDA is available (NCCL), else the CPU (Gloo);
        2. the process group from torchrun's environment (``env://``); started without a
           launcher (no ``WORLD_SIZE``), a group of this one process;
        3. torch threads: this host's cores shared by its workers."""
        cuda = torch.cuda.is_available()
        if cuda:                                                                               # 1.
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        backend = "nccl" if cuda else "gloo"
        if "WORLD_SIZE" in os.environ:                                                         # 2.
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(dist.destroy_process_group)
        _threads(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))                              # 3.
        return dist.get_rank(), dist.get_world_size()

    def allgather_object(self, obj, name: str):
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def trainer(self, cfg: RunConfig, data, rank: int, size: int) -> "TorchTrainer":
        return TorchTrainer(cfg, data, rank, size, self)

    def distribute(self, cfg: RunConfig, model, opt, total: int | None = None) -> tuple:
        """DDP broadcasts rank 0's weights as it wraps the model; the hook takes the optimizer's
        momentum and weight decay when the config asks for momentum correction."""
        ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        state = rddp.register(ddp, compression=compression_of(cfg), optimizer=opt, total_steps=total)
        return ddp, opt, state

    def optimizer_step(self, opt, scaler) -> None:
        scaler.step(opt)   # a disabled scaler just steps
        scaler.update()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(self.device)
        dist.all_reduce(out)
        return out.cpu()


class FSDPAdapter(DDPAdapter):
    """Start-up of a PyTorch process under torchrun (``engine: fsdp``): FSDP2's sharded training."""
    framework, engine = "torch", "fsdp"

    def distribute(self, cfg: RunConfig, model, opt, total: int | None = None) -> tuple:
        """1. rank 0's weights on every rank (FSDP shards what each rank holds); 2. ``fully_shard``
        on every module that holds parameters itself, then on the model; 3. the optimizer again,
        on the sharded parameters; 4. the compressed reduce-scatter on every group."""
        for t in [*model.parameters(), *model.buffers()]:                                      # 1.
            dist.broadcast(t.data, src=0)
        rfsdp.shard(model, self.device)                                                        # 2.
        opt = build_optimizer(cfg, model, dist.get_world_size())                               # 3.
        state = rfsdp.register(model, compression=cfg.compression.model_dump(), optimizer=opt)  # 4.
        return model, opt, state

    def save_states(self, model, opt) -> tuple:
        """This rank's shards (plain tensors: a checkpoint loads with weights_only)."""
        return rfsdp.local_state(model.state_dict()), rfsdp.local_state(opt.state_dict())

    def load_states(self, model, opt, model_state: dict, opt_state: dict) -> None:
        rfsdp.load_local_state(model, opt, model_state, opt_state)

    def eval_batches(self, loader) -> int:
        """Every rank runs as many forwards as the rank with the most test batches: each FSDP
        forward gathers the weights, a collective every rank must join."""
        n = torch.tensor([len(loader)], dtype=torch.int64, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n)


class TorchTrainer:
    framework = "torch"

    def __init__(self, cfg: RunConfig, data, rank: int, size: int, adapter):
        self.cfg, self.data, self.rank, self.size, self.adapter = cfg, data, rank, size, adapter
        self.engine, self.device = adapter.engine, adapter.device
        self.task, self.train_size = data.task, len(data.train)
        self.net = build_model(cfg.model.name, data.num_classes, data.input_shape, **cfg.model.options).to(self.device)
        base = build_optimizer(cfg, self.net, size)
        self.lr0 = base.param_groups[0]["lr"]   # scaled for this run's workers
        # model: what the forward runs through (the DDP wrapper); comm: what reports the exchange
        total = total_steps(cfg, self.train_size // cfg.training.batch_size)   # the runner's count (runner.py)
        self.model, self.opt, self.comm = adapter.distribute(cfg, self.net, base, total)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.training.precision == "fp16")
        if self.scaler.is_enabled():
            self.comm.set_grad_scaler(self.scaler)
            # the scaler skips steps that overflow (the first ones, while it finds its scale)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
        self.sched = None

    def set_steps_per_epoch(self, steps: int) -> None:
        self.comm.set_steps_per_epoch(steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_factor(self.cfg, steps))

    def _batch(self, indices: torch.Tensor):
        ds = self.data.train
        items = ds.__getitems__(indices.tolist()) if hasattr(ds, "__getitems__") else [ds[i] for i in indices.tolist()]
        x, y = default_collate(items)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def step(self, indices: torch.Tensor, step: int) -> tuple:
        x, y = self._batch(indices)
        with autocast(self.cfg.training.precision, self.device):
            loss, correct, n = loss_and_correct(self.model, x, y, self.task)
        self.opt.zero_grad()
        self.scaler.scale(loss).backward()   # a disabled scaler returns the loss itself
        self.adapter.optimizer_step(self.opt, self.scaler)
        self.sched.step()
        return loss.item(), correct, n

    def lr(self, step: int) -> float:
        return self.sched.get_last_lr()[0]

    def sync_next_step(self) -> None:
        """Before a run's last step: local steps end it with an exchange (``sync_next_step``)."""
        sync = getattr(self.comm, "sync_next_step", None)   # the Horovod optimizer, or the DDP hook's state
        if sync is not None:
            sync()

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
        self.net.eval()
        test = self.data.test
        loader = DataLoader(Subset(test, list(range(self.rank, len(test), self.size))),
                            batch_size=max(256, self.cfg.training.batch_size))
        tot = torch.zeros(3, dtype=torch.float64)
        rounds, first = self.adapter.eval_batches(loader), None
        for x, y in loader:
            x, y = x.to(self.device), y.to(self.device)
            first = first if first is not None else (x[:1], y[:1])
            with autocast(self.cfg.training.precision, self.device):
                loss, correct, n = loss_and_correct(self.net, x, y, self.task)
            tot += torch.tensor([loss.item() * n, correct, n], dtype=torch.float64)
        for _ in range(rounds - len(loader)):   # a forward that joins the others' collectives, not scored
            x, y = first if first is not None else tuple(t.to(self.device) for t in default_collate([test[0]]))
            with autocast(self.cfg.training.precision, self.device):
                loss_and_correct(self.net, x, y, self.task)
        tot = self.adapter.sum(tot)
        self.net.train()
        return {"test_loss": tot[0].item() / max(1, tot[2].item()),
                "test_accuracy": tot[1].item() / max(1, tot[2].item())}

    def state_dict(self) -> dict:
        model, optimizer = self.adapter.save_states(self.net, self.opt)
        state = {"engine": self.engine, "model": model, "optimizer": optimizer, "scheduler": self.sched.state_dict()}
        if self.comm is not self.opt:   # the DDP hook's residuals (Horovod's are in the optimizer's)
            state["compression"] = self.comm.state_dict()
        if self.scaler.is_enabled():
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """The saved state, with the learning rate of this run: a checkpoint of M workers under
        ``scale_lr_by_workers`` carries lr * M, and this run has N (the same value otherwise)."""
        saved = state.get("engine", "horovod")
        if saved != self.engine:
            raise ValueError(f"training.resume points at an engine: {saved} checkpoint (its residuals and optimizer "
                             f"state are kept the {saved} way); resume it with engine: {saved}, or start afresh")
        self.adapter.load_states(self.net, self.opt, state["model"], state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.sched.base_lrs = [self.lr0] * len(self.opt.param_groups)
        for group, factor in zip(self.opt.param_groups, self.sched.lr_lambdas):
            group["initial_lr"], group["lr"] = self.lr0, self.lr0 * factor(self.sched.last_epoch)
        if "compression" in state:
            self.comm.load_state_dict(state["compression"])
        if self.scaler.is_enabled() and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def communication_stats(self) -> dict:
        return self.comm.communication_stats()

    def layer_decisions(self) -> list:
        return self.comm.layer_decisions()

    def decision_record(self) -> dict:
        exchange = self.carrier()
        return exchange.decision_record() if exchange is not None else {"source": "none", "layers": []}

    def carrier(self):
        """The GradientExchange whose per-step allreduce can carry the runner's flags (None: none,
        e.g. the decentralized optimizer or DDP's dense fast path)."""
        return getattr(self.comm, "exchange", None)
