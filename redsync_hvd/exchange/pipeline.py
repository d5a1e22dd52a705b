"""The gradient exchange: GRACE's pipeline, per layer or per bucket, framework-neutral.

Adapters feed it torch tensors from gradient hooks (so early layers overlap the rest of
backward) and take averaged torch tensors back. One unit (a layer, or a whole bucket when the
compressor selects by bucket) goes through:

    1. compensate    x = memory.compensate(g)           r + g   (DGC: u = m*u + g; x = r + u)
    2. compress      msg = compressor.compress(x)        what goes on the wire, what was sent
    3. update memory memory.update(x, msg)               x -= decode(msg): the new residual
    4. send          transport.send(msg)                 allreduce, or a bucket's allgather

through the bucket-level methods (``compensate_bucket``, ``compress_bucket``, ``update_bucket``),
whose defaults loop over the unit's layers; a compressor that selects a bucket at once on the
device (RedSync's ``selection.method: radix``) makes each step one call over one flat buffer.
``finish()`` then waits, decodes and averages, has every rank agree that every gradient was
finite (the step's one read of a device value on the host), and only then commits the
memories; any failure calls ``abort()``, which rolls them back, so a failed step loses nothing.
"""
from __future__ import annotations

import math

import torch

from ..compressors.base import Compressor, Layer
from ..compressors.dense import NoneCompressor
from ..core import layout
from ..core.selection import NonFiniteError
from ..core.stats import CommStats
from ..memory import NoMemory
from .step import Bucket, StepState, Unit
from .transport import Transport


class NonFiniteGradientError(FloatingPointError):
    pass


class GradientExchange:
    """One step: ``submit(name, grad)`` for every layer (from hooks), then ``finish()``.

    layers: the parameters; ``policy.setup`` decides how each travels (``network``: what the
        cost-model policy plans for, None for the static policy).
    memory: residual memory for compressed layers (None: no error feedback).
    check_finite: agree across ranks that the step was finite (else every rank raises).
    on_nonfinite: "raise" (NonFiniteGradientError) | "skip": roll back and return gradients
        filled with inf, so a GradScaler skips the step (fp16 training; :meth:`use_grad_scaler`
        sets it).
    clip_norm: DGC's local clipping; each worker's share of the norm is clip_norm * N**-0.5.
    grads_writable: the caller's gradients may be reduced in place (the torch adapter's .grad).
    """

    def __init__(self, layers: list, compressor: Compressor, comm, policy, memory=None, *,
                 check_finite: bool = True, on_nonfinite: str = "raise", fusion_bytes: int = 16 << 20,
                 clip_norm: float | None = None, reuse_buffers: bool = True, grads_writable: bool = False,
                 network=None):
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not 'raise' or 'skip'")
        for layer in layers:
            if layer.numel == 0:
                raise ValueError(f"parameter {layer.name!r} has zero elements: there is nothing to exchange. "
                                 "Remove it from named_parameters or set requires_grad=False")
        self.layers = {l.name: l for l in layers}
        self.order = [l.name for l in layers]
        self.compressor, self.dense = compressor, NoneCompressor()
        self.comm, self.policy = comm, policy
        self.memory = memory if memory is not None else NoMemory()
        self.check_finite, self.on_nonfinite = check_finite, on_nonfinite
        self.grads_writable = grads_writable
        self.clip = clip_norm * comm.size ** -0.5 if clip_norm else None
        self.grad_scale = None   # a GradScaler's scale: residuals keep unscaled values
        self.scaler = None       # where the scale comes from, once per step (use_grad_scaler)
        self.stats = CommStats()
        self.step = 0
        self.applied: list = []
        # values a caller adds to the finite check's allreduce (summed over ranks), e.g. the
        # runner's stop flags: carry() -> [float, ...], the sums land in ``carried``
        self.carry = None
        self.carried: list | None = None
        policy.setup(layers, comm.size, network)
        buckets = self._buckets(layers, fusion_bytes)
        self.units = self._units(layers, buckets)
        self.transport = Transport(comm, self.stats, self.layers, buckets, reuse_buffers)
        self.state = StepState()

    def _buckets(self, layers: list, fusion_bytes: int) -> list:
        if self.compressor.collective != "allgather":
            return []
        parts = layout.buckets([l.numel for l in layers], fusion_bytes, include=lambda i: layers[i].compressed)
        grouped = [tuple(layers[j] for j in part) for part in parts]
        return [Bucket(i, group, self.policy.aggregation(group)) for i, group in enumerate(grouped)]

    def _units(self, layers: list, buckets: list) -> dict:
        units = {l.name: Unit((l,)) for l in layers}
        for bucket in buckets:
            if self.compressor.selects_by_bucket(list(bucket.layers)):
                units.update(dict.fromkeys((l.name for l in bucket.layers), Unit(bucket.layers, together=True)))
        return units

    def parts(self, layer: Layer) -> tuple:
        """(compressor, memory) of a layer: dense layers skip both (their residual would stay 0)."""
        return (self.compressor, self.memory) if layer.compressed else (self.dense, NoMemory())

    def use_grad_scaler(self, scaler) -> None:
        """Gradients arrive multiplied by ``scaler``'s scale (``torch.amp.GradScaler``, fp16).

        1. each step, with its first gradient, the scale is taken as a device tensor
           (``scaler.scale(1)``: no host read) into ``grad_scale``: ``_prepare`` divides by it,
           so residuals and the wire hold unscaled values;
        2. the averages are multiplied by it again, so the scaler's ``unscale_`` is right;
        3. an overflow (inf/NaN on any rank) rolls the memories back and returns inf-filled
           gradients (``on_nonfinite="skip"``): the scaler skips the step and lowers its scale.
        """
        if not scaler.is_enabled():
            return   # it scales nothing
        if not self.check_finite:
            raise ValueError("a GradScaler skips the steps whose gradients overflow, and the exchange must roll "
                             "its residuals back on those steps: set compression.check_finite: true (the default)")
        self.scaler, self.on_nonfinite = scaler, "skip"

    # -- per layer, from the hook ----------------------------------------------------------
    def submit(self, name: str, grad: torch.Tensor) -> None:
        layer = self.layers[name]
        if name in self.state.submitted:
            raise RuntimeError(f"gradient of {name!r} submitted twice in one step; call step() or "
                               "synchronize() between backward passes, or raise backward_passes_per_step")
        if self.scaler is not None and not self.state.submitted:   # the step's first gradient
            self.grad_scale = self.scaler.scale(torch.ones((), device=grad.device))
        self.state.submitted.add(name)
        if layer.compressed and self.compressor.blocking:
            # it waits on a collective inside compress: run in the fixed layer order in finish(), as
            # ranks whose backward passes produce gradients in different orders could deadlock here
            self.state.deferred[name] = grad
            return
        self._stage(layer, grad)

    def _stage(self, layer: Layer, grad: torch.Tensor) -> None:
        """Prepare one gradient; run its unit once the unit's last layer is in."""
        comp, memory = self.parts(layer)
        layer.density = self.policy.density(layer, self.step)
        with self.stats.timer("select", "sparse" if layer.compressed else "dense"):
            g = self._prepare(layer, comp, grad)
            unit = self.units[layer.name]
            inputs = self.state.inputs.setdefault(unit.key, {})
            inputs[layer.name] = g
            if len(inputs) < len(unit.layers):
                return   # the bucket's other layers are still in backward: the hook never waits
            del self.state.inputs[unit.key]
            msgs = self._run(unit, comp, memory, [inputs[l.name] for l in unit.layers])
        for l, msg in zip(unit.layers, msgs):
            self.transport.send(self.state, comp, l, msg)                         # 4. send

    def _run(self, unit: Unit, comp: Compressor, memory, grads: list) -> list:
        """Steps 1-3 for one unit (a layer, or a bucket compressed together); returns the
        messages to send. ``scan``: what the selection wants from the compensation's pass (one
        request per layer, or one for a bucket), filled by the memory where it can fuse it."""
        layers = list(unit.layers)
        scan = None if isinstance(memory, NoMemory) else comp.scan_request_bucket(layers, self.step)
        xs = memory.compensate_bucket(layers, grads, scan)                          # 1. compensate
        msgs = self._compress(unit, comp, memory, grads, xs, scan)                  # 2. compress
        for layer, x, msg in zip(layers, xs, msgs):
            self.transport.own(comp, layer.name, x, msg, self.grads_writable and isinstance(memory, NoMemory))
        if comp.error_feedback == "aggregate":
            self.state.aggregate.update((l.name, x) for l, x in zip(layers, xs))   # x -= the average, in finish()
        else:
            memory.update_bucket(layers, xs, msgs, comp, scan)                      # 3. update memory
            if not isinstance(memory, NoMemory):   # entries no owner keeps come back in finish()
                self.state.kept.update((l.name, x) for l, x in zip(layers, xs) if self.transport.returns(l))
        return msgs

    def _compress(self, unit: Unit, comp: Compressor, memory, grads: list, xs: list, scan) -> list:
        if unit.together:
            msgs = comp.compress_bucket(xs, list(unit.layers), self.step, scan)
            flags = [(l.name, m.nonfinite) for l, m in zip(unit.layers, msgs) if isinstance(m.nonfinite, torch.Tensor)]
            if flags:   # device flags, one stack for the unit: no host wait now
                self.state.evidence.append((tuple(n for n, _ in flags),
                                            torch.where(torch.stack([f for _, f in flags]), math.inf, 0.0)))
            for layer, msg in zip(unit.layers, msgs):
                if not isinstance(msg.nonfinite, torch.Tensor) and msg.nonfinite:
                    self._mark_bad(layer.name)   # sent empty; every rank fails the step in finish()
            return msgs
        (layer,), (x,) = unit.layers, xs
        scan = scan[0] if scan is not None else None
        try:
            return [comp.compress(x, layer, self.step, scan)]
        except NonFiniteError:
            # keep the collectives well formed: compress the residual alone; finish() fails the step
            self._mark_bad(layer.name)
            xs[0] = memory.compensate(layer.name, torch.zeros_like(grads[0]))
            return [comp.compress(xs[0], layer, self.step)]

    def _prepare(self, layer: Layer, comp: Compressor, grad: torch.Tensor) -> torch.Tensor:
        """Flat fp32 gradient (fp16/bf16 accepted), unscaled, locally clipped; finite evidence.
        A unit whose compressor reads fp16/bf16 itself (``keeps_low_precision``) gets them as
        they are when there is nothing to scale or clip: no fp32 copy of every gradient."""
        flat = grad.detach().reshape(-1)
        keep = (self.grad_scale is None and self.clip is None and flat.dtype in (torch.float16, torch.bfloat16)
                and layer.compressed and comp.keeps_low_precision(list(self.units[layer.name].layers)))
        if not keep:
            flat = flat.float()
        if self.grad_scale is not None:
            flat = flat / self.grad_scale
        # compressors that select from every value check for NaN/Inf in a pass they make anyway;
        # others get one summing pass here, read back once in finish() (a read per layer would
        # stall a GPU once per layer). A NaN may travel meanwhile: every rank then fails the step.
        if self.check_finite and not (layer.compressed and comp.checks_finite):
            self.state.evidence.append(((layer.name,), flat.sum()))
        if self.clip is not None:
            # on the device, no host read: a factor of 1.0 leaves the values bit for bit
            flat = flat * (self.clip / flat.norm().clamp(min=1e-30)).clamp(max=1.0)
        if not layer.compressed and self.memory.corrects_momentum:
            self.state.momentum_after.append(layer.name)   # momentum correction: applied to the average
        return flat

    def _mark_bad(self, name: str) -> None:
        if not self.check_finite:
            raise NonFiniteError(f"non-finite gradient values in {name} (NaN or Inf): refusing to select")
        self.state.bad.append(name)

    # -- per step ------------------------------------------------------------------------------
    def missing(self) -> list:
        return [n for n in self.order if n not in self.state.submitted]

    def finish(self, into: dict | None = None, apply: dict | None = None) -> dict:
        """Wait for every collective; return {name: averaged flat gradient}.

        ``into``: optional {name: flat float32 tensor} to decode sparse layers into (the torch
        adapter passes the .grad tensors, saving a copy); the result then is that tensor.
        ``apply``: optional {name: (flat float32 parameter, lr)}: a layer among these that
        travelled sparse by allgather is decoded straight into its parameter as
        p -= lr * average (a plain SGD step), once every check has passed, and is left out
        of the result (``self.applied`` lists them). No dense gradient is written for it.
        """
        missing = self.missing()
        if missing:
            raise RuntimeError(f"finish() before gradients of {missing[:5]} were submitted")
        self.applied = []   # a skipped step applies nothing
        try:
            for name in [n for n in self.order if n in self.state.deferred]:
                self._stage(self.layers[name], self.state.deferred.pop(name))
            flag = self._start_finite_agreement()
            apply = apply or {}
            out, updates = self.transport.collect(self.state, lambda l: self.parts(l)[0], into or {}, apply)
            if flag is not None and self._any_nonfinite(flag):
                return self._nonfinite(out)   # raises, or (on_nonfinite="skip") rolls back
            self._after_average(out, updates, apply)
        except BaseException:
            self.abort()
            raise
        self.memory.commit()
        self.compressor.commit()
        self._end_step()
        return out

    def _start_finite_agreement(self):
        """Every rank's count of non-finite layers, with the values of ``carry`` (the runner's stop
        and save flags; every rank must set the same carry), summed by one tiny allreduce. The count
        is made where the evidence (sums, device flags) lies, so nothing is read back before it."""
        if not self.check_finite:
            return None
        count = torch.tensor([float(len(self.state.bad))])
        if self.state.evidence:
            values = torch.cat([v.reshape(-1).float() for _, v in self.state.evidence])
            count = (~torch.isfinite(values)).sum(dtype=torch.float32).reshape(1) + float(len(self.state.bad))
        if self.carry is not None:
            count = torch.cat([count, torch.tensor([float(v) for v in self.carry()], device=count.device)])
        self.stats.add_bytes({"scalars": 4})   # the carried values are the caller's traffic, not compression's
        return self.comm.allreduce_async(count, name="rsync.finite", average=False)

    def _any_nonfinite(self, flag) -> bool:
        """The step's one host read: the agreed count of non-finite layers (after the decode), and
        the carried values the caller reads in ``carried``."""
        values = self.comm.wait(flag).tolist()
        self.carried = values[1:] if self.carry is not None else None
        return values[0] > 0

    def _nonfinite(self, out: dict) -> dict:
        for names, v in self.state.evidence:   # which of this rank's layers, for the message
            self.state.bad += [n for n, ok in zip(names, torch.isfinite(v.reshape(-1).float()).tolist()) if not ok]
        bad = self.state.bad
        if self.on_nonfinite == "skip":
            self.abort()
            for t in out.values():
                t.fill_(math.inf)
            return out
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN/Inf) at step {self.step}"
            + (f" in {bad[:5]} on this rank" if bad else " on another rank")
            + ". No update was applied and the residuals were left as they were. "
              "Lower the learning rate, clip gradients, or check the input data; "
              "compression.check_finite=false disables this check.")

    def _after_average(self, out: dict, updates: list, apply: dict) -> None:
        """What needs the average: PowerSGD's residual, DGC momentum of dense layers, and (last:
        nothing after it may fail, the weights change) sparse updates."""
        for name, x in self.state.aggregate.items():
            self.memory.update_aggregate(name, x, out[name])
        if self.state.momentum_after:
            with self.stats.timer("decompress", "allreduce"):
                self.memory.dense_momentum(self.state.momentum_after, [out[n] for n in self.state.momentum_after])
        if self.grad_scale is not None:
            for t in out.values():
                t.mul_(self.grad_scale)   # the caller's GradScaler unscales them again
        if updates:
            with self.stats.timer("decompress", "allgather"):
                for layer, tensors, alpha in updates:
                    self.compressor.decompress_add(apply[layer.name][0], tensors, layer, alpha=alpha)
        self.applied = sorted({layer.name for layer, _, _ in updates})

    def abort(self) -> None:
        """Drop this step: the memories (and the compressor's state) roll back, the step's figures
        are discarded."""
        self.memory.rollback()
        self.compressor.rollback()
        self.state = StepState()
        self.stats.step.clear()

    def _end_step(self) -> None:
        self.stats.end_step()
        self.step += 1
        self.state = StepState()

    # -- accessors, once for every adapter -----------------------------------------------------
    def communication_stats(self) -> dict:
        """Cumulative per-worker figures since start (:class:`~redsync_hvd.core.stats.CommStats`),
        the last step's, and per layer."""
        out = self.stats.summary()
        out["last_step"] = dict(getattr(self.stats, "last", {}))
        out["layers"] = dict(self.stats.layers)
        return out

    def layer_decisions(self) -> list:
        """How each layer travels (compressed or dense, density, and why), decided once at start."""
        return list(self.policy.decisions)

    def decision_record(self) -> dict:
        """The decisions with the figures they were made from (``LayerPolicy.record``): what a
        run folder's decisions.json and a checkpoint keep, and ``policy.decisions`` pins."""
        return self.policy.record()

    def set_steps_per_epoch(self, steps: int) -> None:
        """Needed by epoch-based schedules such as ``warmup.epochs``."""
        self.policy.steps_per_epoch = int(steps)

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "memory": self.memory.state_dict(), "compressor": self.compressor.state_dict(),
                "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        if state.get("memory"):
            self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state.get("compressor", {}))
        if "stats" in state:
            self.stats.load_state_dict(state["stats"])
