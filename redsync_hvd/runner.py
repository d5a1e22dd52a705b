"""One training loop for every framework and engine (``python -m redsync_hvd.train``).

A framework adapter supplies a :class:`Trainer`: one training step on a batch of sample
indices, an evaluation, its state, and its communication figures. The loop is written once:

    1. resume (:func:`resume`, before the trainer is built): every rank loads its own
       checkpoint and all agree, in one collective, on step, world size and config
       (redsync_hvd/checkpoint.py); the checkpoint's layer decisions are pinned for the trainer
    2. per epoch: the shuffled order of this rank's shard (a seeded generator, replayed on resume)
    3. per step: trainer.step(indices); a metrics.jsonl line every log_every steps
    4. evaluation every eval_every steps (else each epoch's end) and at the last step
    5. checkpoints (redsync_hvd/checkpoint.py: atomic, one file per rank) every checkpoint_every
       steps, every checkpoint_every_s seconds and at the end; on SIGTERM/SIGINT every rank
       saves at one agreed step and the run stops (redsync_hvd/preemption.py); summary.json
"""
from __future__ import annotations

import math
import sys
import time
from typing import Callable, Protocol

import torch
from torch.utils.data import DataLoader

from . import checkpoint, resize
from .config import RunConfig, validate
from .config.run import RESUMABLE
from .preemption import EXIT_STOPPED, StopController, allgather_max
from .runlog import RunLog

# seconds between the loop's own stop polls on steps whose exchange did not carry the flags
POLL_EVERY_S = 1.0


class Trainer(Protocol):
    framework: str
    task: str                       # "classification" | "lm"
    train_size: int                 # samples in this rank's shard

    def step(self, indices: torch.Tensor, step: int) -> tuple:
        """One training step on these sample indices: (loss, correct, count)."""

    def evaluate(self) -> dict:
        """Test figures summed over all ranks: test_loss, test_accuracy (and extras)."""

    def lr(self, step: int) -> float: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def communication_stats(self) -> dict: ...
    def layer_decisions(self) -> list: ...
    def set_steps_per_epoch(self, steps: int) -> None: ...

    # optional: decision_record() -> dict (decisions and the figures behind them; else
    # {"layers": layer_decisions()}), carrier() -> the GradientExchange whose per-step allreduce
    # carries the stop flags, or None (else the loop polls on its own)


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    if cfg.training.steps:
        return cfg.training.steps
    return max(1, int(round(cfg.training.epochs * steps_per_epoch)))


def lr_factor(cfg: RunConfig, steps_per_epoch: int):
    """step -> factor of the base learning rate: linear warm-up, then step or cosine decay."""
    sched = cfg.optimizer.schedule
    total = total_steps(cfg, steps_per_epoch)

    def factor(step: int) -> float:
        epoch = step / max(1, steps_per_epoch)
        f = 1.0
        if sched.warmup_epochs and epoch < sched.warmup_epochs:
            f *= (step + 1) / (sched.warmup_epochs * steps_per_epoch)
        if sched.type == "step":
            f *= sched.gamma ** sum(epoch >= m for m in sched.milestones)
        elif sched.type == "cosine":
            f *= 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total))))
        return f
    return factor


def eval_due(cfg: RunConfig, step: int, steps_per_epoch: int, total: int) -> bool:
    """Every ``training.eval_every`` steps, else at each epoch's end; always at the last step."""
    every = cfg.training.eval_every
    return bool((every and step % every == 0) or (not every and step % steps_per_epoch == 0) or step == total)


# -- resume -----------------------------------------------------------------------------------
def resume(cfg: RunConfig, rank: int, size: int, allgather_object: Callable) -> checkpoint.Resumed | None:
    """``training.resume``: this rank's checkpoint, agreed with every other rank (or None).

    1. ``checkpoint.resume``: load, then one allgather of step, world size, fingerprint (or
       the load error); on another world size ``training.on_resize`` decides, and summed
       residuals are scaled so the owed weight update stays ``lr / N * sum r``.
    2. The checkpoints' experiment fingerprint must be this config's (RESUMABLE keys aside);
       otherwise the keys that differ are named.
    Raises :class:`checkpoint.CheckpointError`, the same on every rank."""
    if not cfg.training.resume:
        return None
    if rank == 0:
        print(f"[resume] {cfg.training.resume}: every rank checks its checkpoint (step, workers, config)",
              file=sys.stderr, flush=True)
    o = cfg.optimizer
    lr_of = (lambda n: o.lr * n) if o.scale_lr_by_workers else (lambda n: o.lr)
    r = checkpoint.resume(cfg.training.resume, rank, size, lambda obj: allgather_object(obj, name="rsync.resume"),
                          on_resize=cfg.training.on_resize,
                          scale=lambda m, n: resize.pending_update_scale(m, n, lr_of(m), lr_of(n)))
    if r.agreement.fingerprint != cfg.experiment_fingerprint():
        raise checkpoint.CheckpointError(
            f"cannot resume: {cfg.training.resume} holds checkpoints of another experiment: "
            f"{config_diff(r.blob.get('config') or {}, cfg)}. Resume with the config that wrote them; a resume may "
            f"change only {', '.join(RESUMABLE)}", cfg.training.resume, rank, "mismatch")
    return r


def config_diff(saved: dict, cfg: RunConfig) -> str:
    """'key: saved -> now' for the experiment keys that differ (the same text on every rank)."""
    try:
        before = validate(saved).experiment()
    except Exception:   # noqa: BLE001 - a config of an older schema: compare what is there
        before = saved
    flat_before, flat_now = _flatten(before), _flatten(cfg.experiment())
    keys = sorted(k for k in set(flat_before) | set(flat_now) if flat_before.get(k) != flat_now.get(k)
                  and not any(k == r or k.startswith(r + ".") for r in RESUMABLE))
    return ", ".join(f"{k}: {flat_before.get(k)!r} -> {flat_now.get(k)!r}" for k in keys[:8]) or \
        "the fingerprints differ"


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def trainer_config(cfg: RunConfig, resumed: checkpoint.Resumed | None) -> RunConfig:
    """The config the trainer is built from: on resume, with the checkpoint's layer decisions
    pinned (``compression.policy.decisions``), so no layer switches between dense and
    compressed while its residual is in the checkpoint, and nothing is probed again."""
    record = resumed.blob.get("decisions") if resumed is not None else None
    if not record or not record.get("layers") or not hasattr(cfg.compression, "policy"):
        return cfg
    out = cfg.model_copy(deep=True)
    out.compression.policy.decisions = {**record, "pinned_from": f"checkpoint {cfg.training.resume} "
                                                                 f"(step {resumed.agreement.step})"}
    return out


# -- the loop -------------------------------------------------------------------------------------
class Run:
    """The loop's state: where it is, what it has measured, and its run folder."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, rank: int, size: int,
                 resumed: checkpoint.Resumed | None = None, allgather_object: Callable | None = None):
        self.cfg, self.trainer, self.rank, self.size = cfg, trainer, rank, size
        self.resumed, self.allgather_object = resumed, allgather_object
        self.gen = torch.Generator().manual_seed(cfg.training.seed * 1000 + rank)
        self.loader = DataLoader(range(trainer.train_size), batch_size=cfg.training.batch_size, shuffle=True,
                                 drop_last=True, generator=self.gen)
        self.steps_per_epoch = len(self.loader)
        self.step, self.t_eval, self.result = 0, 0.0, {}
        self.epoch_rng = self.gen.get_state()
        self.log, self.record, self.resumes, self.stopped = None, {}, [], None

    def start(self) -> None:
        cfg = self.cfg
        self.total = total_steps(cfg, self.steps_per_epoch)
        self.trainer.set_steps_per_epoch(self.steps_per_epoch)
        record = getattr(self.trainer, "decision_record", None)
        self.record = record() if record is not None else {"layers": self.trainer.layer_decisions()}
        self.log = RunLog(cfg.output.dir, cfg.output.name or "run", self.rank)
        if self.rank == 0:
            write_layer_decisions(self.record["layers"], self.log.dir / "layers.log")
        self.log.write_config(cfg.to_dict(), self.resumed.agreement.step if self.resumed else None)
        self.log.decisions(self.record)
        if self.resumed is not None:                                                # 1.
            self._restore(self.resumed)

    def _restore(self, r: checkpoint.Resumed) -> None:
        """The agreed checkpoint's state. After a resize the old epoch order cannot be replayed
        (the shards changed): a new order is drawn from (seed, rank, step)."""
        self.trainer.load_state_dict(r.blob)
        self.step = r.agreement.step
        if r.agreement.resized:
            self.gen.manual_seed(self.cfg.training.seed * 1000 + self.rank + 7919 * self.step)
        else:
            self.gen.set_state(r.blob["generator"])
        entry = {"step": self.step, "from": str(self.cfg.training.resume), "workers": self.size,
                 "old_workers": r.agreement.old_size, "resize": r.report}
        self.resumes = list(r.blob.get("resumes") or []) + [entry]
        self.log.metrics({"step": self.step, "event": "resumed", **entry})
        if self.rank == 0:
            what = "" if r.report is None else (
                f"; {r.agreement.old_size} -> {self.size} workers, on_resize={r.report['rule']}: "
                f"{r.report['dropped_elements']} residual elements dropped")
            print(f"[resume] step {self.step} from {self.cfg.training.resume}{what}", file=sys.stderr, flush=True)

    def save(self, reason: str, keep: bool = False) -> None:
        """Latest state per rank (residuals are per worker), atomically (checkpoint.save keeps
        the previous one as .prev); ``keep`` also leaves a per-step copy."""
        blob = {"framework": self.trainer.framework, "step": self.step, "world_size": self.size,
                "fingerprint": self.cfg.experiment_fingerprint(), "generator": self.epoch_rng,
                "config": self.cfg.to_dict(), "decisions": self.record, "resumes": self.resumes,
                **self.trainer.state_dict()}
        checkpoint.save(self.log.dir, self.rank, blob, keep_step=keep)
        self.ctl.saved()
        self.log.metrics({"step": self.step, "event": "checkpoint", "reason": reason})

    def train(self) -> None:
        self.ctl = self._stop_controller()
        bar = progress_bar(self)
        t_start = time.perf_counter()
        try:
            while self.step < self.total and self.stopped is None:
                skip = self.step % self.steps_per_epoch
                self.epoch_rng = self.gen.get_state()   # the loader draws this epoch's order from here   # 2.
                for i, indices in enumerate(self.loader):
                    if i < skip:
                        continue   # resumed mid-epoch: these batches were seen
                    self._one_step(indices, bar)
                    if self.step >= self.total or self.stopped is not None:
                        break
            if bar is not None:
                bar.close()
            if self.stopped is None:
                self.save("end")
                if not self.result:   # resumed at the last step
                    self.result = self.trainer.evaluate()
        finally:
            self.ctl.uninstall()
            if self.carrier is not None:
                self.carrier.carry = None
        self.wall = time.perf_counter() - t_start

    def _stop_controller(self) -> StopController:
        """Signals and the wall clock, agreed through the exchange's per-step allreduce where the
        trainer has one (no collective of its own), else by a poll about every POLL_EVERY_S."""
        carrier = getattr(self.trainer, "carrier", lambda: None)()
        self.carrier = carrier if self.allgather_object is not None else None
        if self.allgather_object is None:   # nothing to agree through: no signal handling, no timed saves
            return StopController(lambda values: values, checkpoint_every_s=0, poll_every=1 << 62)
        ctl = StopController(allgather_max(self.allgather_object), poll_every_s=POLL_EVERY_S,
                             checkpoint_every_s=self.cfg.training.checkpoint_every_s).install()
        if self.carrier is not None:
            self.carrier.carry = ctl.flags
        return ctl

    def _one_step(self, indices, bar) -> None:
        if self.carrier is not None:
            self.carrier.carried = None
        loss, correct, n = self.trainer.step(indices, self.step)                   # 3.
        self.step += 1
        cfg, step = self.cfg, self.step
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if step % cfg.training.log_every == 0 or step == self.total:
            self._log_train(loss, correct / n)
        if eval_due(cfg, step, self.steps_per_epoch, self.total):                 # 4.
            t0 = time.perf_counter()
            self.result = self.trainer.evaluate()
            self.t_eval += time.perf_counter() - t0
            self.log.metrics({"step": step, "epoch": step / self.steps_per_epoch, **self.result,
                              "wire_bytes": self.trainer.communication_stats()["wire_bytes"]})
        self._checkpoint(step)                                                      # 5.

    def _checkpoint(self, step: int) -> None:
        """Save when a step-based or wall-clock checkpoint is due or a stop was agreed."""
        carried = self.carrier.carried if self.carrier is not None else None
        decision = self.ctl.decide(carried) if carried is not None else self.ctl.poll(step)
        every = self.cfg.training.checkpoint_every
        keep = bool(every and step % every == 0)
        if keep or decision.save:
            self.save(decision.reason if decision.save else "checkpoint_every", keep=keep)
        if decision.stop:
            self.stopped = decision.reason
            self.log.metrics({"step": step, "event": "stopped", "reason": decision.reason})

    def _log_train(self, loss: float, train_accuracy: float) -> None:
        stats = self.trainer.communication_stats()
        last = stats.pop("last_step", {})
        stats.pop("layers", None)
        self.log.metrics({"step": self.step, "epoch": self.step / self.steps_per_epoch, "loss": loss,
                          "train_accuracy": train_accuracy, "lr": self.trainer.lr(self.step),
                          "step_wire_bytes": last.get("wire_bytes", 0), **stats,
                          "last_step": {k: v for k, v in last.items() if k != "dense_bytes"}})

    def finish(self) -> dict:
        summary = build_summary(self)
        self.log.summary(summary)
        self.log.close()
        if self.rank == 0:
            suffix = "" if self.trainer.framework == "torch" else f" (framework {self.trainer.framework})"
            print(f"done: {self.log.dir} accuracy={summary['final_accuracy']:.4f} wire_bytes={summary['wire_bytes']} "
                  f"ratio={summary['compression_ratio']:.1f}{suffix}")
        return summary

    def finish_stopped(self) -> int:
        """After an agreed stop: every rank has saved before rank 0 says so, and rank 0 has said
        so before any rank exits (a launcher tears the job down at the first non-zero exit);
        no summary (unfinished)."""
        self.ctl.barrier()
        self.log.close()
        if self.rank == 0:
            print(f"{self.ctl.message(self.step, self.log.dir)} (exit code {EXIT_STOPPED}: saved, not finished)",
                  file=sys.stderr, flush=True)
        self.ctl.barrier()
        return EXIT_STOPPED


def run(cfg: RunConfig, trainer: Trainer, rank: int, size: int, *, resumed: checkpoint.Resumed | None = None,
        allgather_object: Callable | None = None) -> int:
    """Train to the end (0); EXIT_STOPPED after a SIGTERM/SIGINT stop that saved every rank;
    2 (after a clear message) when the shard is smaller than one batch. ``allgather_object``
    (the adapter's) carries the stop polls on steps whose exchange has no allreduce to share."""
    loop = Run(cfg, trainer, rank, size, resumed, allgather_object)
    if loop.steps_per_epoch == 0:
        print(f"error: training.batch_size={cfg.training.batch_size} exceeds this rank's shard "
              f"({trainer.train_size} samples); lower it", file=sys.stderr)
        return 2
    loop.start()
    loop.train()
    if loop.stopped is not None:
        return loop.finish_stopped()
    loop.finish()
    return 0


def write_layer_decisions(decisions, path) -> None:
    """The per-layer decision (compressed or dense, and why), written once by rank 0 to the run
    folder's layers.log (summary.json has them too), not to the terminal."""
    with open(path, "w") as f:
        for d in decisions:
            path = f"; aggregation {d['aggregation']} ({d['aggregation_why']})" if d.get("aggregation") else ""
            print(f"[layers] {d['name']}: {'compressed' if d['compressed'] else 'dense'} "
                  f"(numel {d['numel']}, density {d['density']:g}; {d['why']}){path}", file=f)


def progress_bar(loop: Run):
    if loop.rank != 0 or not loop.cfg.training.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=loop.total, initial=loop.step, desc=loop.cfg.output.name, unit="step", file=sys.stderr)


def build_summary(loop: Run) -> dict:
    """summary.json: final test figures, bytes, time per phase, per-layer figures and decisions."""
    stats = loop.trainer.communication_stats()
    stats.pop("last_step", None)
    layers = stats.pop("layers", {})
    phases = {p: stats.pop(p) for p in ("select", "communicate", "decompress")}
    result = loop.result
    extra = {"final_perplexity": math.exp(min(result["test_loss"], 50))} if loop.trainer.task == "lm" and result \
        else {}
    return {
        "final_accuracy": result.get("test_accuracy"), "final_loss": result.get("test_loss"), **extra,
        "wire_bytes": stats["wire_bytes"], "dense_bytes": stats["dense_bytes"],
        "compression_ratio": stats["compression_ratio"], "steps": loop.step, "workers": loop.size,
        "wall_time_s": loop.wall,
        "time_breakdown": {**phases, "eval": loop.t_eval,
                           "compute": max(0.0, loop.wall - loop.t_eval - sum(phases.values()))},
        "compression": loop.cfg.compression.model_dump(mode="json"), "comm_detail": stats,
        "layers": layers, "layer_decisions": loop.trainer.layer_decisions(),
        "decisions_source": loop.record.get("source"), "resumes": loop.resumes,
    }
