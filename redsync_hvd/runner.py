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
       saves at one agreed step and the run stops (redsync_hvd/preemption.py; what each
       launcher leaves a rank to do it in: redsync_hvd/launchers.py); summary.json
"""
from __future__ import annotations

import io
import os
import sys
import time
from typing import Callable, Protocol

import torch
from torch.utils.data import DataLoader

from . import checkpoint, launchers, progress, resize
from .config import RunConfig, validate
from .config.run import RESUMABLE
from .policy.budget import log_lines as budget_log_lines
from .policy.review import review_log_lines
from .preemption import EXIT_STOPPED, QuietStream, StopController, allgather_max, say
from .runlog import RunLog, build_summary, test_figures, write_layer_decisions
from .schedule import eval_due, total_steps

# seconds between the loop's own stop polls on steps whose exchange did not carry the flags
POLL_EVERY_S = 1.0
# steps timed after the first (warm-up) to compare a stop's duration with the launcher's window
WINDOW_STEPS = 5


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


# -- resume -----------------------------------------------------------------------------------
def resume(cfg: RunConfig, rank: int, size: int, allgather_object: Callable) -> checkpoint.Resumed | None:
    """``training.resume``: this rank's checkpoint, agreed with every other rank (or None).

    1. ``checkpoint.resume``: load, then one allgather of step, world size, fingerprint (or
       the load error); on another world size ``training.on_resize`` decides, and summed
       residuals are scaled so the owed weight update stays ``lr / N * sum r``.
    2. The checkpoints' experiment fingerprint must be this config's (RESUMABLE keys aside), or
       their saved config, read by this version, must be this run's experiment
       (:func:`same_experiment`); otherwise the keys that differ are named.
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
    if r.agreement.fingerprint != cfg.experiment_fingerprint() and not same_experiment(r.blob.get("config"), cfg):
        raise checkpoint.CheckpointError(
            f"cannot resume: {cfg.training.resume} holds checkpoints of another experiment: "
            f"{config_diff(r.blob.get('config') or {}, cfg)}. Resume with the config that wrote them; a resume may "
            f"change only {', '.join(RESUMABLE)}", cfg.training.resume, rank, "mismatch")
    return r


def same_experiment(saved: dict | None, cfg: RunConfig) -> bool:
    """Whether checkpoints saved by an older version, whose fingerprint counted fewer keys, hold
    this run's experiment: their full config, read by this version, gives the same experiment.
    A key added since is read at its default, and a new key lands at the behaviour it did not
    change; every key the old version had is in the saved config with its value, so a default
    that changed since does not pass for the old one. The saved config is the same on every rank
    (the ranks agreed on its fingerprint), so every rank decides the same."""
    try:
        return validate(saved or {}).experiment_fingerprint() == cfg.experiment_fingerprint()
    except Exception:   # noqa: BLE001 - a config this version cannot read is another experiment
        return False


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
                 resumed: checkpoint.Resumed | None = None, allgather_object: Callable | None = None,
                 relayed: bool = False, data: dict | None = None):
        self.cfg, self.trainer, self.rank, self.size = cfg, trainer, rank, size
        self.resumed, self.allgather_object, self.data = resumed, allgather_object, data
        self.gen = torch.Generator().manual_seed(cfg.training.seed * 1000 + rank)
        self.loader = DataLoader(range(trainer.train_size), batch_size=cfg.training.batch_size, shuffle=True,
                                 drop_last=True, generator=self.gen)
        self.steps_per_epoch = len(self.loader)
        self.step, self.t_eval, self.result = 0, 0.0, {}
        self._policy, self._revision, self._logged = None, None, 0   # a policy that chooses again (budget)
        self._paths: list = []   # how the exchange's planned buckets ran, as last logged
        self.replay = 0          # batches of a finished epoch to go through unseen after a resume
        self.epoch_rng = self.gen.get_state()
        self.log, self.record, self.resumes, self.stopped = None, {}, [], None
        self.last_save: dict = {}   # this rank's latest save: file, seconds, when it was done
        self.relayed = relayed      # launchers.start_relay passes the launcher's signal on to this rank
        self.bar, self._timing = None, None

    def start(self) -> None:
        cfg = self.cfg
        self.total = total_steps(cfg, self.steps_per_epoch)
        self.trainer.set_steps_per_epoch(self.steps_per_epoch)
        record = getattr(self.trainer, "decision_record", None)
        self.record = record() if record is not None else {"layers": self.trainer.layer_decisions()}
        self.log = RunLog(cfg.output.dir, cfg.output.name or "run", self.rank)
        if self.rank == 0:
            write_layer_decisions(self.record["layers"], self.log.dir / "layers.log", self.record.get("notes", ()))
        self.log.write_config(cfg.to_dict(), self.resumed.agreement.step if self.resumed else None)
        self.log.decisions(self.record)
        if self.resumed is not None:                                                # 1.
            self._restore(self.resumed)
        self._policy = getattr(getattr(self.trainer, "carrier", lambda: None)(), "policy", None)
        self._note_decisions()

    def _restore(self, r: checkpoint.Resumed) -> None:
        """The agreed checkpoint's state, and the random streams (the epoch's shuffling, torch's
        global generators: dropout, augmentation) where they were. After a resize the old epoch
        order cannot be replayed (the shards changed): new ones are drawn from (seed, rank, step)."""
        self.trainer.load_state_dict(r.blob)
        self.step = r.agreement.step
        if r.agreement.resized:
            self.gen.manual_seed(self.cfg.training.seed * 1000 + self.rank + 7919 * self.step)
            torch.manual_seed(self.cfg.training.seed * 1000 + self.rank + 7919 * self.step)
        else:
            self.gen.set_state(r.blob["generator"])   # the start of the epoch of the last step taken
            set_global_rng(r.blob.get("rng"))
            if self.step and self.step % self.steps_per_epoch == 0:
                # that epoch is over: the loader goes through it once more, unseen, so its
                # generator leaves it as the uninterrupted run's did (the sampler draws again
                # when it runs out)
                self.replay = self.steps_per_epoch
        entry = {"step": self.step, "from": str(self.cfg.training.resume), "workers": self.size,
                 "old_workers": r.agreement.old_size, "resize": r.report, "saved_on": r.blob.get("reason"),
                 "fallback": r.fallback, "at": time.time()}
        self.resumes = resume_history(r.blob.get("resumes") or [], self.log.events("resumed")) + [entry]
        self.log.metrics({"step": self.step, "event": "resumed", **entry})
        if self.rank == 0:
            say(f"[resume] step {self.step} from {self.cfg.training.resume}{resume_details(r, self.size)}")

    def blob(self, reason: str) -> dict:
        return {"framework": self.trainer.framework, "step": self.step, "world_size": self.size,
                "fingerprint": self.cfg.experiment_fingerprint(), "generator": self.epoch_rng,
                "config": self.cfg.to_dict(), "decisions": self.record, "resumes": self.resumes,
                "reason": reason, "rng": global_rng(), **self.trainer.state_dict()}

    def save(self, reason: str, keep: bool = False) -> None:
        """Latest state per rank (residuals are per worker), atomically (checkpoint.save keeps
        the previous one as .prev); ``keep`` also leaves a per-step copy."""
        t0 = time.perf_counter()
        path = checkpoint.save(self.log.dir, self.rank, self.blob(reason), keep_step=keep)
        self.last_save = {"file": str(path), "save_s": time.perf_counter() - t0, "saved_at": time.time()}
        self.ctl.saved()
        self.log.metrics({"step": self.step, "event": "checkpoint", "reason": reason,
                          "save_s": self.last_save["save_s"]})

    def train(self) -> None:
        self.ctl = self._stop_controller()
        self.bar = progress_bar(self)
        t_start = time.perf_counter()
        try:
            while self.step < self.total and self.stopped is None:
                skip, self.replay = self.step % self.steps_per_epoch or self.replay, 0
                self.epoch_rng = self.gen.get_state()   # the loader draws this epoch's order from here   # 2.
                for i, indices in enumerate(self.loader):
                    if i < skip:
                        continue   # resumed mid-epoch (or at its end): these batches were seen
                    self._one_step(indices)
                    if self.step >= self.total or self.stopped is not None:
                        break
            if self.bar is not None:
                self.bar.close()
            if self.stopped is None:
                self.save("end")
                if not self.result:   # resumed at the last step
                    self.result = test_figures(self.trainer)
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
        launched = launchers.kind(os.environ) is not None
        ctl = StopController(allgather_max(self.allgather_object), poll_every_s=POLL_EVERY_S,
                             checkpoint_every_s=self.cfg.training.checkpoint_every_s,
                             force_on_repeat=not launched).install()
        if launched:
            ctl.watch_parent()
        if self.carrier is not None:
            self.carrier.carry = ctl.flags
        return ctl

    def _one_step(self, indices) -> None:
        if self.carrier is not None:
            self.carrier.last = None
        if self.step + 1 == self.total and hasattr(self.trainer, "sync_next_step"):
            self.trainer.sync_next_step()   # local steps: every worker ends on the same weights
        loss, correct, n = self.trainer.step(indices, self.step)                   # 3.
        self.step += 1
        self._note_decisions()
        self._note_paths()
        cfg, step = self.cfg, self.step
        self._time_steps()
        if self.bar is not None and self.ctl.signum:   # stopping: write nothing the launcher may not read
            self.bar.close()
            self.bar = None
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(1)
        if step % cfg.training.log_every == 0 or step == self.total:
            self._log_train(loss, correct / n)
        if eval_due(cfg, step, self.steps_per_epoch, self.total):                 # 4.
            t0 = time.perf_counter()
            self.result = test_figures(self.trainer)
            self.t_eval += time.perf_counter() - t0
            self.log.metrics({"step": step, "epoch": step / self.steps_per_epoch, **self.result,
                              "wire_bytes": self.trainer.communication_stats()["wire_bytes"]})
        self._checkpoint(step)                                                      # 5.

    def _note_paths(self) -> None:
        """Which path runs each planned bucket (eager, or replayed from a CUDA graph once captured):
        rank 0 appends each change to layers.log and says it once on stdout."""
        paths = getattr(self.carrier, "paths", None)
        now = paths() if paths is not None and (self.step <= 8 or self.step % 100 == 0) else self._paths
        if now == self._paths:
            return
        self._paths = now
        if self.rank == 0:
            lines = [f"[path] step {self.step}: {line}" for line in now]
            with open(self.log.dir / "layers.log", "a") as f:
                f.writelines(line + "\n" for line in lines)
            print("\n".join(lines), flush=True)

    def _note_decisions(self) -> None:
        """A policy that chooses again while training (``policy.mode: budget``): each new choice is
        appended to layers.log and rewrites decisions.json and the record checkpoints keep."""
        revision = getattr(self._policy, "log_revision", None)
        if revision is None or revision == self._revision:
            return
        self._revision = revision
        self.record = self.trainer.decision_record()
        lines = []
        if "budget" in self.record:
            lines = budget_log_lines(self.record["budget"], self._logged)
            self._logged = len(self.record["budget"]["history"])
        elif "review" in self.record:   # the cost model's buckets, with what each window measured
            lines = review_log_lines(self.record["review"])
        if self.rank == 0 and lines:
            with open(self.log.dir / "layers.log", "a") as f:
                f.writelines(line + "\n" for line in lines)
        self.log.decisions(self.record)

    def _checkpoint(self, step: int) -> None:
        """Save when a step-based or wall-clock checkpoint is due or a stop was agreed. A step-based
        save without this step's carried flags polls first: under local steps the ranks meet only
        at exchanges, and one rank could otherwise save steps ahead of another, so that a job
        killed then holds no step on every rank (the resume's ``.prev`` covers one save apart)."""
        every = self.cfg.training.checkpoint_every
        keep = bool(every and step % every == 0)
        last = self.carrier.last if self.carrier is not None else None
        carried = last.carried if last is not None else None
        decision = self.ctl.decide(carried) if carried is not None else self.ctl.poll(step, force=keep)
        if decision.stop:
            self.stopped, self.agreed_at = decision.reason, time.time()
        if keep or decision.save:
            self.save(decision.reason if decision.save else "checkpoint_every", keep=keep)

    def _time_steps(self) -> None:
        """After the first step, time WINDOW_STEPS more; then rank 0 says in one line if a stop
        (about two steps and a save) may not fit in what the launcher leaves it
        (launchers.window_note), once per launch."""
        now = time.perf_counter()
        if self._timing is None:
            self._timing = (self.step, now)
            return
        first, t0 = self._timing
        if self.step - first != WINDOW_STEPS or self.rank != 0:
            return
        t1 = time.perf_counter()
        torch.save(self.blob("probe"), io.BytesIO())   # a save's serialisation; the write comes on top
        note = launchers.window_note(os.environ, (now - t0) / WINDOW_STEPS, time.perf_counter() - t1, self.relayed)
        if note:
            say(note)

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
            ppl = f" perplexity={summary['final_perplexity']:.2f}" if "final_perplexity" in summary else ""
            sys.stdout.write(f"done: {self.log.dir} accuracy={summary['final_accuracy']:.4f}{ppl} "   # one write:
                             f"wire_bytes={summary['wire_bytes']} ratio={summary['compression_ratio']:.1f}{suffix}\n")
            sys.stdout.flush()   # mpirun tags each write it forwards
        return summary

    def finish_stopped(self) -> int:
        """After an agreed stop:

        1. one allgather of every rank's save (file, seconds, when it heard the signal): every
           rank has saved before rank 0 says so;
        2. rank 0 records the stop in metrics.jsonl (summary.json's ``stops`` lists them) and
           prints the resume hint (under horovodrun its process prints it once the job has ended,
           so a mpirun that a second signal ends at once cannot drop it; to a closed stderr:
           nowhere, quietly);
        3. a barrier: rank 0 has said so before any rank exits (a launcher tears the job down
           at the first non-zero exit). No summary (unfinished)."""
        mine = {**self.last_save, "heard_at": self.ctl.heard_at, "agreed_at": getattr(self, "agreed_at", None)}
        ranks = self.allgather_object(mine, name="rsync.stopped")                           # 1.
        self.log.metrics({"step": self.step, "event": "stopped", "reason": self.stopped,    # 2.
                          "files": [r.get("file") for r in ranks], "save_s": [r.get("save_s") for r in ranks],
                          "heard_at": [r["heard_at"] for r in ranks], "agreed_at": [r["agreed_at"] for r in ranks],
                          "saved_at": [r.get("saved_at") for r in ranks]})
        self.log.close()
        if self.rank == 0:   # into the launch's log even where mpirun ends at once (launchers.tell)
            launchers.tell(f"{self.ctl.message(self.step, self.log.dir)} (exit code {EXIT_STOPPED}: saved, not "
                           "finished)")
        self.ctl.barrier()                                                                  # 3.
        return EXIT_STOPPED


def run(cfg: RunConfig, trainer: Trainer, rank: int, size: int, *, resumed: checkpoint.Resumed | None = None,
        allgather_object: Callable | None = None, relayed: bool = False, data: dict | None = None) -> int:
    """Train to the end (0); EXIT_STOPPED after a SIGTERM/SIGINT stop that saved every rank;
    2 (after a clear message) when the shard is smaller than one batch. ``allgather_object``
    (the adapter's) carries the stop polls on steps whose exchange has no allreduce to share;
    ``relayed``: a relay passes the launcher's signals on to this rank (launchers.start_relay);
    ``data`` (``DataBundle.record()``) goes to summary.json as it is."""
    loop = Run(cfg, trainer, rank, size, resumed, allgather_object, relayed, data)
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


def resume_history(saved: list, logged: list) -> list:
    """Every earlier resume, oldest first: those the checkpoint carries, and those only this run
    folder's metrics.jsonl remembers (a launch killed before any rank saved again, whose run was
    then resumed from the same step), each once (by its time)."""
    seen, out = set(), []
    for entry in [*saved, *({k: v for k, v in e.items() if k != "event"} for e in logged)]:
        key = entry.get("at") or (entry.get("step"), entry.get("from"))
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return sorted(out, key=lambda e: e.get("at") or 0.0)


def resume_details(r: checkpoint.Resumed, size: int) -> str:
    """What the [resume] line adds: a resize and what it dropped, a fallback to .prev files."""
    what = "" if r.report is None else (
        f"; {r.agreement.old_size} -> {size} workers, on_resize={r.report['rule']}: "
        f"{r.report['dropped_elements']} residual elements dropped")
    if r.fallback is not None:
        what += (f"; the latest saves were of steps {r.fallback['latest']} (a save cut short), so ranks "
                 f"{[i for i, f in enumerate(r.fallback['files']) if f != 'latest']} resume from .prev")
    return what


def global_rng() -> dict:
    """torch's global generators (CPU, and every CUDA device's): dropout and data augmentation
    draw from them, so a resume that did not restore them would train on other draws."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_global_rng(state: dict | None) -> None:
    if not state:
        return   # a checkpoint of an older version: torch.manual_seed(training.seed) stands
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def progress_bar(loop: Run):
    """Rank 0's (``training.progress``): a bar on a terminal, a line every few seconds into a pipe
    or a file (redsync_hvd/progress.py)."""
    if loop.rank != 0 or not loop.cfg.training.progress:
        return None
    return progress.progress_bar(loop.total, loop.step, loop.cfg.output.name, QuietStream(sys.stderr))
