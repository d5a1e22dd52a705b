"""The gradient exchange: GRACE's pipeline, per layer or per bucket, framework-neutral.

Adapters feed it torch tensors from gradient hooks (so early layers overlap the rest of
backward) and take averaged torch tensors back. One unit (a layer, or a whole bucket when the
compressor selects by bucket) goes through:

    1. compensate    c = memory.compensate(g, compressor.first_pass(...))   x = r + g (DGC: r + u),
                                                                           and the selection's first pass
    2. compress      msg = compressor.compress(c.x, ..., c.first)        what goes on the wire
    3. update memory memory.update(c.x, msg)                             x -= decode(msg): the new residual
    4. send          transport.send(msg)                                 the bucket's allreduce or allgather

A bucket that the compressor keeps flat (RedSync's ``selection.method: radix``: exactly k per
layer on the device) runs the same four steps through its :class:`~redsync_hvd.exchange.plan.BucketPlan`:
one call each over one flat buffer, replayed from a CUDA graph on a GPU. ``finish()`` then waits,
decodes and averages, reads once whether every rank's inputs were finite (the counts ride in the
buckets' own collectives) and only then commits the memories; any failure calls ``abort()``,
which rolls them back, so a failed step loses nothing.
"""
from __future__ import annotations

import math

import torch

from ..compressors.base import Compressor, Layer
from ..compressors.dense import FP16Compressor, NoneCompressor
from ..core import layout
from ..core.selection import NonFiniteError
from ..core.stats import CommStats
from ..core.wire import finite_evidence
from ..memory import NoMemory
from .plan import BucketPlan
from .step import Bucket, StepResult, StepState, Unit
from .transport import Transport


class NonFiniteGradientError(FloatingPointError):
    pass


class GradientExchange:
    """One step: ``submit(name, grad)`` for every layer (from hooks), then ``finish()``.

    layers: the parameters; ``policy.setup`` decides how each travels (``network``: what the
        cost-model policy plans for, None for the static policy), and its config's
        ``policy.dense_values`` how the dense ones do (fp32, or fp16).
    memory: residual memory for compressed layers (None: no error feedback).
    check_finite: agree across ranks that the step was finite (else every rank raises). Off, a
        step whose inputs held NaN/Inf passes them through instead (``_pass_nonfinite``).
    on_nonfinite: "raise" (NonFiniteGradientError) | "skip": roll back and return gradients
        filled with inf, so a GradScaler skips the step (fp16 training; :meth:`use_grad_scaler`
        sets it).
    clip_norm: DGC's local clipping; each worker's share of the norm is clip_norm * N**-0.5.
    cuda_graph: "auto" | "on" | "off": how planned buckets run on CUDA (exchange/graph.py).
    """

    def __init__(self, layers: list, compressor: Compressor, comm, policy, memory=None, *,
                 check_finite: bool = True, on_nonfinite: str = "raise", fusion_bytes: int = 16 << 20,
                 clip_norm: float | None = None, reuse_buffers: bool = True, grads_writable: bool = False,
                 network=None, cuda_graph: str = "auto"):
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not 'raise' or 'skip'")
        for layer in layers:
            if layer.numel == 0:
                raise ValueError(f"parameter {layer.name!r} has zero elements: there is nothing to exchange. "
                                 "Remove it from named_parameters or set requires_grad=False")
        self.layers = {l.name: l for l in layers}
        self.order = [l.name for l in layers]
        self.compressor = compressor
        fp16 = policy.config.policy.dense_values == "fp16"   # the layers that go dense: fp32 or fp16 values
        self.dense = FP16Compressor(comm=comm) if fp16 else NoneCompressor()
        self.comm, self.policy = comm, policy
        self.memory = memory if memory is not None else NoMemory()
        self.check_finite, self.on_nonfinite = check_finite, on_nonfinite
        self.grads_writable = grads_writable
        self.clip = clip_norm * comm.size ** -0.5 if clip_norm else None
        self.grad_scale = None   # a GradScaler's scale: residuals keep unscaled values
        self.scaler = None       # where the scale comes from, once per step (use_grad_scaler)
        self.lr_of = None        # residual_lr: own: () -> this step's learning rate (follow_lr)
        self.lr = None           # the learning rate the residuals are in units of
        self.stats = CommStats()
        self.step = 0
        # values a caller adds to the step's agreement (summed over ranks), e.g. the runner's stop
        # flags: carry() -> [float, ...]; the sums come back in StepResult.carried
        self.carry = None
        self.last: StepResult | None = None   # the last finished step's result
        self.landing: dict = {}               # {name: flat view} handed out by grad_buffers()
        policy.setup(layers, comm.size, network)
        self.buckets = self._buckets(layers, fusion_bytes)
        policy.start_budget(layers, self._control_bytes())
        self.plans = {b.index: BucketPlan(b, compressor, self.memory, cuda_graph) for b in self.buckets
                      if b.kind == "gather" and b.aggregation == "allgather"
                      and compressor.compresses_flat(list(b.layers))
                      and (isinstance(self.memory, NoMemory) or self.memory.flat_ok(b.layers))}
        self.units = self._units(layers)
        self.transport = Transport(comm, self.stats, self.layers, self.buckets, self.plans, reuse_buffers)
        self.state = StepState()

    def _control_bytes(self) -> int:
        """What the buckets send each step besides the messages: each bucket's int32 count of
        non-finite layers, and its size in the header of a gather bucket whose sizes vary."""
        def varies(b) -> bool:
            return b.kind == "gather" and self.parts(b.layers[0])[0].fixed_bucket_counts(list(b.layers)) is None
        return sum(8 if varies(b) else 4 for b in self.buckets)

    def _buckets(self, layers: list, fusion_bytes: int) -> list:
        """Fixed buckets (``core/layout.py``, the partition the cost model prices), one compressor and
        one collective each: compressed allgather layers, compressed allreduce layers, dense layers."""
        def travels(i: int, compressed: bool, collective: str) -> bool:
            return layers[i].compressed == compressed and self.parts(layers[i])[0].collective == collective
        out: list = []
        for compressed, collective in ((True, "allgather"), (True, "allreduce"), (False, "allreduce")):
            parts = layout.buckets([l.numel for l in layers], fusion_bytes,
                                   include=lambda i, c=compressed, k=collective: travels(i, c, k))
            kind = "gather" if collective == "allgather" else "reduce"
            for part in parts:
                group = tuple(layers[j] for j in part)
                how = self.policy.aggregation(group) if kind == "gather" else "allgather"
                out.append(Bucket(len(out), group, kind, how))
        return out

    def _units(self, layers: list) -> dict:
        """A layer each, or a whole bucket: one the compressor selects at once (GPU paths), or the
        layers of a blocking compressor (compressed in finish(), its own collectives batched)."""
        units = {l.name: Unit((l,)) for l in layers}
        for bucket in self.buckets:
            layers_ = list(bucket.layers)
            if not layers_[0].compressed:
                continue
            if self.compressor.blocking:   # in registration order, as finish() runs them (PowerSGD's Q draws)
                unit = Unit(tuple(sorted(layers_, key=lambda l: l.index)), together=True)
            elif bucket.kind == "gather" and self.compressor.selects_by_bucket(layers_):
                unit = Unit(bucket.layers, together=True)
            else:
                continue
            units.update(dict.fromkeys((l.name for l in bucket.layers), unit))
        return units

    def parts(self, layer: Layer) -> tuple:
        """(compressor, memory) of a layer: dense layers skip both (their residual would stay 0)."""
        return (self.compressor, self.memory) if layer.compressed else (self.dense, NoMemory())

    def grad_buffers(self, dtype: torch.dtype, device) -> dict:
        """{name: flat view} where gradients should land: the planned buckets' gradient buffers and,
        for fp32, the dense reduce buckets' fused buffers. An adapter that makes these views the
        parameters' ``.grad`` saves the step a copy per layer (DDP's buckets do the same); a
        gradient elsewhere is copied in."""
        out: dict = {}
        for plan in self.plans.values():
            out.update(plan.gradient_buffer(dtype, device))
        # fp16 dense layers travel as a rounded copy: they have no fused buffer to land in
        if dtype == torch.float32 and self.transport.reuse_buffers and type(self.dense) is NoneCompressor:
            for b in self.buckets:
                if b.kind == "reduce" and not any(l.compressed for l in b.layers):
                    out.update(self.transport.dense_views(b, device))
        self.landing = out
        return out

    def use_grad_scaler(self, scaler) -> None:
        """Gradients arrive multiplied by ``scaler``'s scale (``torch.amp.GradScaler``, fp16).

        1. each step, with its first gradient, the scale is taken as a device tensor
           (``scaler.scale(1)``: no host read) into ``grad_scale``: ``_prepare`` (and each plan)
           divides by it, so residuals and the wire hold unscaled values;
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

    def follow_lr(self, lr: float) -> None:
        """``residual_lr: own``: this step's learning rate, before its first gradient. From a to b
        the residuals are multiplied by a / b, so what waited moves the weights by what it would
        have at its own step (a gradient g of step s, sent at t: lr_t * g * lr_s / lr_t)."""
        lr = float(lr)
        if self.lr is not None and lr != self.lr and lr > 0:
            self.memory.scale(self.lr / lr)
        if lr > 0:
            self.lr = lr

    # -- per layer, from the hook ----------------------------------------------------------
    def submit(self, name: str, grad: torch.Tensor) -> None:
        layer = self.layers[name]
        if name in self.state.submitted:
            raise RuntimeError(f"gradient of {name!r} submitted twice in one step; call step() or "
                               "synchronize() between backward passes, or raise backward_passes_per_step")
        if not self.state.submitted:   # the step's first gradient
            if self.scaler is not None:
                self.grad_scale = self.scaler.scale(torch.ones((), device=grad.device))
            if self.lr_of is not None:
                self.follow_lr(self.lr_of())
            if self.carry is not None:
                self.state.carry = [float(v) for v in self.carry()]
        self.state.submitted.add(name)
        layer.density = self.policy.density(layer, self.step)
        if layer.compressed and self.compressor.blocking:
            # it waits on a collective inside compress: run in the fixed layer order in finish(), as
            # ranks whose backward passes produce gradients in different orders could deadlock here
            self.state.deferred[name] = grad
            return
        self._stage(layer, grad)

    def _stage(self, layer: Layer, grad: torch.Tensor) -> None:
        """Hold one gradient; run its unit once the unit's last layer is in (the hook never waits)."""
        comp, memory = self.parts(layer)
        unit = self.units[layer.name]
        inputs = self.state.inputs.setdefault(unit.key, {})
        inputs[layer.name] = grad
        if len(inputs) < len(unit.layers):
            return
        del self.state.inputs[unit.key]
        grads = [inputs[l.name] for l in unit.layers]
        bucket = self.transport.bucket_of.get(layer.name)
        plan = self.plans.get(bucket.index) if bucket is not None else None
        with self.stats.timer("select", "sparse" if layer.compressed else "dense"):
            if plan is not None:   # the four steps over the bucket's flat buffer
                payload = self._run_plan(plan, grads)
            else:
                msgs = self._run(unit, comp, memory, [self._prepare(l, comp, g) for l, g in zip(unit.layers, grads)])
        if plan is not None:
            self.transport.send_payload(self.state, bucket, payload)                      # 4. send
            return
        for l, msg in zip(unit.layers, msgs):
            self.transport.send(self.state, comp, l, msg)                                 # 4. send

    def _run(self, unit: Unit, comp: Compressor, memory, grads: list) -> list:
        """Steps 1-3 for one unit (a layer, or a bucket compressed together); returns the messages."""
        layers = list(unit.layers)
        cs = [memory.compensate(l.name, g, comp.first_pass(l, self.step)) for l, g in zip(layers, grads)]  # 1.
        self.policy.observe(layers, [c.x for c in cs], self.step, grads)   # policy.mode budget: its steps only
        msgs = self._compress(unit, comp, memory, grads, cs)                                   # 2. compress
        if comp.error_feedback == "aggregate":
            self.state.aggregate.update((l.name, c.x) for l, c in zip(layers, cs))   # x -= the average, in finish()
        else:
            for layer, c, msg in zip(layers, cs, msgs):
                memory.update(layer, c.x, msg, comp)                                           # 3. update memory
            if not isinstance(memory, NoMemory):   # what no owner keeps comes back in finish()
                self.state.kept.update((l.name, c.x) for l, c in zip(layers, cs) if self.transport.returns(l))
        return msgs

    def _compress(self, unit: Unit, comp: Compressor, memory, grads: list, cs: list) -> list:
        if unit.together:
            msgs = comp.compress_bucket([c.x for c in cs], list(unit.layers), self.step, [c.first for c in cs])
            for layer, msg in zip(unit.layers, msgs):
                if msg.nonfinite is True:
                    self._mark_bad(layer.name)   # sent empty; every rank fails the step in finish()
                elif isinstance(msg.nonfinite, torch.Tensor):   # a device flag: counted by the bucket
                    self.state.trace.append(((layer.name,), msg.nonfinite.reshape(1)))
            return msgs
        (layer,), (c,) = unit.layers, cs
        try:
            return [comp.compress(c.x, layer, self.step, c.first)]
        except NonFiniteError:
            # keep the collectives well formed: compress the residual alone; finish() fails the
            # step (check_finite) or passes NaN through for the layer
            self._mark_bad(layer.name)
            cs[0] = memory.compensate(layer.name, torch.zeros_like(grads[0]))
            msg = comp.compress(cs[0].x, layer, self.step)
            msg.nonfinite = True   # its bucket's collective carries the count
            return [msg]

    def _run_plan(self, plan: BucketPlan, grads: list) -> torch.Tensor:
        """A planned bucket's steps 0-4 (plan.py), with this step's scale; its figures per layout."""
        plan.scale, plan.clip = self.grad_scale, self.clip
        observe = self.policy.observe if self.policy.observes(self.step) else None   # policy.mode budget
        payload, flags = plan.run(grads, self.step, observe)
        self.state.trace.append((plan.names, flags))   # read only to name the layers of a failed step
        if plan.account(self.transport.account):   # a new layout: its figures, and its declared sizes
            plan.check(payload)
        return payload

    def _prepare(self, layer: Layer, comp: Compressor, grad: torch.Tensor) -> torch.Tensor:
        """Flat fp32 gradient (fp16/bf16 accepted), unscaled, locally clipped; finite evidence.
        A unit whose compressor reads fp16/bf16 itself (``keeps_low_precision``) gets them as
        they are when there is nothing to scale or clip: no fp32 copy of every gradient."""
        flat = self.landing.get(layer.name)
        if flat is None or flat.data_ptr() != grad.data_ptr() or flat.dtype != grad.dtype:
            flat = grad.detach().reshape(-1)   # (a gradient that landed in its bucket has its flat view ready)
        keep = (self.grad_scale is None and self.clip is None and flat.dtype in (torch.float16, torch.bfloat16)
                and layer.compressed and comp.keeps_low_precision(list(self.units[layer.name].layers)))
        if not keep:
            flat = flat.float()
        if self.grad_scale is not None:
            flat = flat / self.grad_scale
        # a compressed layer whose compressor does not check for NaN/Inf itself gets one pass for
        # its largest magnitude (a sum would overflow on huge finite values), carried by its
        # bucket's collective (dense layers: one norm over the whole bucket, unless they travel
        # as fp16, whose clamp to the finite range would hide an Inf). With check_finite off too:
        # a step that passes NaN through must know which layers to pass it through
        if (layer.compressed or type(comp) is not NoneCompressor) and not comp.checks_finite:
            self._evidence(layer.name, finite_evidence(flat))
        if self.clip is not None:
            # on the device, no host read: a factor of 1.0 leaves the values bit for bit
            flat = flat * (self.clip / flat.norm().clamp(min=1e-30)).clamp(max=1.0)
        if not layer.compressed and self.memory.corrects_momentum:
            self.state.momentum_after.append(layer.name)   # momentum correction: applied to the average
        return flat

    def _evidence(self, name: str, value: torch.Tensor) -> None:
        self.state.trace.append(((name,), value))
        self.state.evidence.setdefault(self.transport.bucket_of[name].index, []).append(value)

    def _mark_bad(self, name: str) -> None:
        self.state.bad.append(name)

    def veto(self, names: list) -> None:
        """Fail this step as a non-finite one, for inputs the caller exchanged itself and found
        NaN/Inf in (the torch adapter's sparse gradients): ``finish`` then rolls back and raises
        (or, with a GradScaler, skips) as for the exchange's own. Every rank must veto alike: call
        it with what every rank received, not with this rank's own inputs."""
        self.state.vetoed = list(names)

    # -- per step ------------------------------------------------------------------------------
    def missing(self) -> list:
        return [n for n in self.order if n not in self.state.submitted]

    def finish(self, into: dict | None = None, apply: dict | None = None) -> StepResult:
        """Wait for every collective; return the step's :class:`StepResult`: {name: averaged flat
        gradient}, the layers applied to the weights, and the carried sums.

        ``into``: optional {name: flat float32 tensor} to decode into (the torch adapter passes the
        .grad tensors, saving a copy); the result then is that tensor.
        ``apply``: optional {name: (flat float32 parameter, lr)}: a layer among these that
        travelled sparse by allgather is decoded straight into its parameter as
        p -= lr * average (a plain SGD step), once every check has passed, and is left out
        of the averages (``StepResult.applied`` lists them). No dense gradient is written for it.
        """
        missing = self.missing()
        if missing:
            raise RuntimeError(f"finish() before gradients of {missing[:5]} were submitted")
        try:
            for name in [n for n in self.order if n in self.state.deferred]:
                self._stage(self.layers[name], self.state.deferred.pop(name))
            carry = self._start_carry()
            apply = apply or {}
            out, updates, flags, carried = self.transport.collect(self.state, lambda l: self.parts(l)[0],
                                                                  into or {}, apply)
            bad, carried = self._read(carry, flags, carried)
            passed = bad and not self.check_finite and not self.state.vetoed
            if (bad or self.state.vetoed) and not passed:
                return self._nonfinite(out, carried)   # raises, or (on_nonfinite="skip") rolls back
            if passed:
                self._pass_nonfinite(out, apply)
            applied = self._after_average(out, updates, apply)
            if passed:
                self.memory.keep_finite()
        except BaseException:
            self.abort()
            raise
        self.memory.commit()
        if passed:
            self.compressor.rollback()   # its state (PowerSGD's warm Q) must not take in the NaN
        else:
            self.compressor.commit()
        self.stats.add_bytes(self.policy.after_step(self.step, self.comm))   # policy.mode budget: may choose
        self._end_step()
        self.last = StepResult(out, applied, carried)
        return self.last

    def _start_carry(self):
        """Where no reduce bucket carries the caller's carry values (every layer travels by
        allgather), one tiny allreduce of them; None otherwise (the usual case)."""
        if self.state.carry is None or self.transport.carrier is not None:
            return None
        self.stats.add_bytes({"scalars": 4})   # the carried values are the caller's traffic, not compression's
        return self.comm.allreduce_async(torch.tensor(self.state.carry, dtype=torch.float32), name="rsync.carry",
                                         average=False)

    def _read(self, carry, flags: list, carried) -> tuple[bool, list | None]:
        """The step's one host read: every bucket's summed or gathered count of non-finite inputs
        and the carried sums, gathered on one device first. Returns (any non-finite, carried sums
        or None)."""
        counts = list(flags)   # read with check_finite off too: a step that holds NaN passes it through
        if carry is not None:
            carried = self.comm.wait(carry)
        if self.state.carry is None:
            carried = None
        tensors = counts + ([carried] if carried is not None else [])
        if not tensors:
            return False, None
        device = tensors[0].device
        values = torch.cat([t.reshape(-1).to(device=device, dtype=torch.float32) for t in tensors]).tolist()
        n = sum(t.numel() for t in counts)
        return any(v > 0 for v in values[:n]), (values[n:n + len(self.state.carry)] if carried is not None else None)

    def _flagged(self) -> list:
        """The layers this rank found NaN/Inf in this step (host reads of the step's evidence)."""
        def flagged(v):   # a flag (bool: set where bad), or evidence (a sum or norm: not finite where bad)
            return v.reshape(-1) if v.dtype == torch.bool else ~torch.isfinite(v.reshape(-1).float())
        return self.state.bad + [n for names, v in self.state.trace for n, b in zip(names, flagged(v).tolist()) if b]

    def _pass_nonfinite(self, out: dict, apply: dict) -> None:
        """check_finite off, and some rank's inputs held NaN/Inf: pass them on as an uncompressed
        average does. Dense fp32 layers hold them already (their sum carries them, element by
        element); a layer that travelled compressed or as fp16 (whose clamp hides an Inf) is NaN
        on every rank where any rank flagged it, agreed by one allreduce of per-layer flags (on
        such steps only). ``finish`` then zeroes what is not finite in the pending memories, after
        the average's own updates, and keeps the compressor's state as it was."""
        names = [n for n in self.order if type(self.parts(self.layers[n])[0]) is not NoneCompressor]
        if not names:
            return
        mine = set(self._flagged())
        flags = torch.tensor([float(n in mine) for n in names], device=self.layers[names[0]].device)
        agreed = self.comm.wait(self.comm.allreduce_async(flags, name="rsync.nonfinite_layers", average=False))
        for name, count in zip(names, agreed.tolist()):
            if count > 0 and name in out:
                out[name].fill_(math.nan)
            elif count > 0 and name in apply:   # sparse_update: the step would write NaN into it
                apply[name][0].fill_(math.nan)

    def _nonfinite(self, out: dict, carried) -> StepResult:
        bad = self._flagged() + self.state.vetoed
        if self.on_nonfinite == "skip":
            self.abort()
            for t in out.values():
                t.fill_(math.inf)
            self.last = StepResult(out, [], carried)
            return self.last
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN/Inf) at step {self.step}"
            + (f" in {bad[:5]} on this rank" if bad else " (on this or another rank)")
            + ". No update was applied and the residuals were left as they were. "
              "Lower the learning rate, clip gradients, or check the input data; "
              "compression.check_finite=false passes NaN/Inf through instead (as an uncompressed average does).")

    def _after_average(self, out: dict, updates: list, apply: dict) -> list:
        """What needs the average: PowerSGD's residual, DGC momentum of dense layers, and (last:
        nothing after it may fail, the weights change) sparse updates. Returns the applied layers."""
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
        return sorted({layer.name for layer, _, _ in updates})

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

    def paths(self) -> list:
        """How each planned bucket's step runs (eager, or replayed from a CUDA graph), for the logs."""
        return [f"bucket {i} ({len(p.layers)} layers, {sum(p.frame.sizes)} elements): exact-k plan, {p.path}"
                for i, p in self.plans.items()]

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
                "stats": self.stats.state_dict(), "lr": self.lr, "policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.lr = state.get("lr")
        if state.get("memory"):
            self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state.get("compressor", {}))
        if "stats" in state:
            self.stats.load_state_dict(state["stats"])
        if state.get("policy"):
            self.policy.load_state_dict(state["policy"])
