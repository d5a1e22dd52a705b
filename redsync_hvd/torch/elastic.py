"""Horovod Elastic (``horovodrun --min-np/--max-np --host-discovery-script``) with residuals kept.

Horovod's ``hvd.elastic.TorchState`` syncs the optimizer after every reset with
``broadcast_optimizer_state`` from rank 0, which would give every worker rank 0's
residual: rank 0's unsent gradient would then be sent N times and every other worker's
lost. :class:`ElasticState` instead

* broadcasts the model and the wrapped optimizer's own state (momentum, lr, step) from
  rank 0 and the exchange's step counter, but leaves each worker's residuals and
  velocities (``optimizer.state_dict()["redsync"]["memory"]``) where they are;
* rolls them back with the rest of the optimizer to the last ``commit()`` when a
  collective fails (a worker died), as Horovod does for the model;
* applies the world-size rule of :mod:`redsync_hvd.resize` when the set of workers
  changes: ``"sum"``: survivors keep their residuals (conserved), joiners start with none,
  and what the departed workers held at the last commit is lost and counted;
  ``"reset"``: every residual is dropped and counted. ``"error"`` is refused at
  construction: an elastic job resizes by design, so the choice is needed up front.

Each ``commit()`` also gathers every worker's nonzero residual count (one small
allgather), so that after a failure the survivors know how much the departed held.

    state = ElasticState(model, optimizer, on_resize="sum", epoch=0, batch=0)

    @redsync_hvd.torch.elastic.run
    def train(state):
        for state.batch in range(state.batch, steps):
            ...; optimizer.step(); state.commit()

    train(state);  state.resizes   # one report per resize: sizes, departed, dropped elements

A worker that joins builds its DistributedOptimizer before it enters ``run``, and the
constructor runs one collective, the config check; after a reset the survivors run the
same check in ``sync`` so that the joiner finds partners (without it, both sides wait
forever: the joiner in the check, the survivors in the model broadcast).

Refused: SBC's local steps and the decentralized methods (a model per worker, which the
model broadcast would overwrite), and ``policy: cost_model`` unless ``policy.decisions``
pins its decisions (it probes the network with collectives in the constructor, which a
joiner cannot match).
"""
from __future__ import annotations

import copy
import os
import socket
import sys

import horovod.torch as hvd
from horovod.common.elastic import ObjectState
from horovod.torch.elastic import run
from horovod.torch.elastic.state import ModelStateHandler, StateHandler, TorchState, _get_handlers

from .. import resize
from ..engine import check_same_everywhere
from ..memory import NoMemory

__all__ = ["ElasticState", "run"]


def _memory(optimizer):
    memory = optimizer.exchange.memory
    return None if isinstance(memory, NoMemory) else memory


def _abort_step(optimizer) -> None:
    """Forget a step a failed collective interrupted (submitted layers, handles, pending buffers)."""
    optimizer.abort_step()


class ResidualKeepingOptimizerHandler(StateHandler):
    """Like Horovod's OptimizerStateHandler, but ``sync`` leaves per-worker state alone."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._saved = copy.deepcopy(optimizer.state_dict())

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        _abort_step(self.value)
        # a copy: load_state_dict may keep the tensors it is given, and the snapshot must stay intact
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self):
        from . import broadcast_optimizer_state  # the wrapped optimizer's state only, not the residuals
        broadcast_optimizer_state(self.value, root_rank=0, initialize=False)   # no step before the first
        ex = self.value.exchange   # its step drives density schedules: the same on every rank
        ex.step = hvd.broadcast_object(ex.step, root_rank=0, name="rsync.elastic.step")


class ElasticState(TorchState):
    """``hvd.elastic.TorchState`` for a redsync_hvd ``DistributedOptimizer``.

    ``on_resize``: "sum" or "reset" (see the module docstring). ``residual_scale``: optional
    ``f(old_size, new_size) -> factor`` applied to the survivors' residuals under "sum"
    (e.g. :func:`redsync_hvd.resize.pending_update_scale` when the lr does not follow the
    worker count). Other keyword arguments are tracked as Horovod does (samplers, plain values).
    """

    def __init__(self, model, optimizer, on_resize: str, residual_scale=None, **kwargs):
        resize.check_rule(on_resize)
        if on_resize == "error":
            raise resize.ResizeError("an elastic job changes its number of workers by design: choose what "
                                     "happens to the residuals of workers that leave: on_resize='sum' (survivors "
                                     "keep theirs, the departed's are lost and counted) or 'reset' (all dropped "
                                     "and counted)")
        config = getattr(optimizer, "compression_config", None)
        if config is None or config.strategy != "exchange" or config.delayed:
            raise resize.ResizeError("local steps (sbc, or local_steps > 1) and decentralized methods keep a model "
                                     "per worker, which Horovod Elastic's model broadcast would overwrite; use them "
                                     "without --min-np, or set compression.local_steps: 1")
        if config.policy.mode == "cost_model" and config.policy.decisions is None:
            raise resize.ResizeError("policy: cost_model probes the network with collectives when the optimizer "
                                     "is built, which a worker joining an elastic job cannot run with the others "
                                     "(and its decisions depend on the number of workers); use policy: static, or "
                                     "pin the decisions of an earlier run (policy.decisions: <run>/decisions.json)")
        self._rule, self._scale = on_resize, residual_scale
        self._worker = f"{socket.gethostname()}:{os.getpid()}"
        self._census = None   # {worker id: nonzero counts} at the last commit
        self._fresh = True    # this process built its optimizer (and ran its config check) just now
        self.resizes: list = []
        self._handlers = {"model": ModelStateHandler(model), "optimizer": ResidualKeepingOptimizerHandler(optimizer)}
        extra, plain = _get_handlers(kwargs)
        self._handlers.update(extra)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        ObjectState.__init__(self, bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **plain)

    def sync(self):
        """Horovod's sync (model, optimizer state, plain values from rank 0), preceded after a
        reset by the config check that a joining worker's DistributedOptimizer constructor
        runs: the survivors take part in it, so the joiner is not left waiting (and a joiner
        with another config or model is refused on every rank). A fresh worker ran it already."""
        if not self._fresh:
            opt = self.optimizer
            check_same_everywhere(opt.exchange.comm, opt.compression_config, list(opt.exchange.layers.values()))
        self._fresh = False
        super().sync()

    def commit(self):
        """Count every worker's residual (one allgather, which also shows whether the workers
        changed since the last commit), save (local), then check for host changes.

        The count comes before the save: if a worker dies during it, every survivor rolls back
        to the previous save, whose counts are the census kept, so the two always match."""
        counts = resize.nonzero(self._memory_state())
        census = dict(hvd.allgather_object((self._worker, counts), name="rsync.elastic.census"))
        if self._census is not None and set(census) != set(self._census):
            self._report(self._census, census)
        self._census = census
        self.save()
        self.check_host_updates()

    def reset(self):
        """After a reset (workers left or joined), before any sync; local only, no collective
        (Horovod skips the sync when workers only left, and joiners never get here).

        1. "reset": drop this worker's residuals (the count is taken from the last census).
        2. "sum" with ``residual_scale``: scale them for the new number of workers.
        """
        memory, old, new = _memory(self.optimizer), len(self._census or {}), hvd.size()
        if memory is None or not old:
            return
        if self._rule == "reset":
            memory.load_state_dict({key: {} for key in resize.MEMORY_KEYS})
        elif self._scale is not None and old != new:
            merged, _ = resize.merge([memory.state_dict()], "sum", float(self._scale(old, new)))
            memory.load_state_dict({key: merged.get(key, {}) for key in resize.MEMORY_KEYS} | merged)

    def _memory_state(self) -> dict | None:
        """The residual/velocity dicts themselves (no copy: only counted)."""
        memory = _memory(self.optimizer)
        if memory is None:
            return None
        return {"residual": memory.residual, "velocity": getattr(memory, "velocity", {})}

    def _report(self, before: dict, after: dict) -> None:
        """One resize, seen at the first commit after it: who left or joined and what was dropped
        (what the departed held at the last commit; under "reset" what everyone held)."""
        departed = [w for w in before if w not in after]
        lost_from = list(before) if self._rule == "reset" else departed
        dropped = {k: sum(before[w][k] for w in lost_from) for k in resize.MEMORY_KEYS}
        report = {"rule": self._rule, "old_world_size": len(before), "new_world_size": len(after),
                  "departed": len(departed), "joined": len([w for w in after if w not in before]),
                  "dropped": dropped, "dropped_elements": sum(dropped.values())}
        self.resizes.append(report)
        if hvd.rank() == 0:
            print(f"[elastic] {report['old_world_size']} -> {report['new_world_size']} workers "
                  f"({report['departed']} left, {report['joined']} joined; on_resize={self._rule}): "
                  f"{report['dropped_elements']} residual elements dropped", file=sys.stderr, flush=True)
