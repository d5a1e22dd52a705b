"""The gradient exchange: GRACE's pipeline over fixed buckets, framework-neutral.

Adapters feed it torch tensors from gradient hooks (so early buckets overlap the rest of backward)
and take averaged torch tensors back:

    1. build   every layer is grouped once into a bucket (``core/layout.py``), and each bucket's
               route chosen then: planned (exactly k per layer on the device, planned.py),
               gather, reduce (buckets.py) or the sparse reduce-scatter (scatter.py)
    2. submit  each gradient goes to its bucket, which compensates, compresses, updates the
               memory and, once its last layer is in, starts its own collective
    3. finish  every bucket waits and decodes; the step's one host read learns whether every
               rank's inputs were finite (each bucket carried its count in its collective); only
               then do the memories commit. Any failure calls ``abort()``, which rolls them
               back, so a failed step loses nothing.
"""
from __future__ import annotations

import torch

from ..compressors.base import Compressor, Layer
from ..compressors.dense import FP16Compressor, NoneCompressor
from ..core import layout
from ..core.stats import CommStats
from ..memory import NoMemory
from ..policy.costmodel import Network, ride_cap
from . import nonfinite, redecide
from .buckets import Buffers, ReduceBucket
from .gather import GatherBucket
from .planned import PlannedBucket
from .scatter import ScatterBucket, ScatterGroup
from .step import StepResult, StepState


class GradientExchange:
    """One step: ``submit(name, grad)`` for every layer (from hooks), then ``finish()``.

    layers: the parameters; ``policy.setup`` decides how each travels (``network``: what the
        cost-model policy plans for, None for the static policy), and its config's
        ``policy.dense_values`` how the dense ones do (fp32, or fp16).
    memory: residual memory for compressed layers (None: no error feedback).
    check_finite: agree across ranks that the step was finite (else every rank raises). Off, a
        step whose inputs held NaN/Inf passes them on instead (``nonfinite.pass_on``).
    on_nonfinite: "raise" (NonFiniteGradientError) | "skip": roll back and return gradients
        filled with inf, so a GradScaler skips the step (fp16 training; :meth:`use_grad_scaler`).
    clip_norm: DGC's local clipping; each worker's share of the norm is clip_norm * N**-0.5.
    reuse_buffers: outputs live in buffers kept across steps (False: fresh ones, for callers that
        keep them longer, as a TF tensor sharing their memory does).
    cuda_graph: "auto" | "on" | "off": how planned buckets run on CUDA (exchange/graph.py).
    """

    def __init__(self, layers: list, compressor: Compressor, comm, policy, memory=None, *,
                 check_finite: bool = True, on_nonfinite: str = "raise", fusion_bytes: int = 16 << 20,
                 clip_norm: float | None = None, reuse_buffers: bool = True, network=None,
                 cuda_graph: str = "auto"):
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not 'raise' or 'skip'")
        for layer in layers:
            if layer.numel == 0:
                raise ValueError(f"parameter {layer.name!r} has zero elements: there is nothing to exchange. "
                                 "Remove it from named_parameters or set requires_grad=False")
        self.layers = {l.name: l for l in layers}
        self.order = [l.name for l in layers]
        self.compressor, self.comm, self.policy = compressor, comm, policy
        self.dense_fp16 = policy.config.policy.dense_values == "fp16"   # how the layers that go dense travel
        self.dense = FP16Compressor(comm=comm) if self.dense_fp16 else NoneCompressor()
        self.memory = memory if memory is not None else NoMemory()
        self.check_finite, self.on_nonfinite = check_finite, on_nonfinite
        self.check_finite_unset = False   # the config left it to the method (build_exchange says)
        self.clip = clip_norm * comm.size ** -0.5 if clip_norm else None
        self.scaler = None       # a GradScaler (use_grad_scaler): its scale is taken once per step
        self.lr_of = None        # residual_lr: own: () -> this step's learning rate (follow_lr)
        self.lr = None           # the learning rate the residuals are in units of
        self.stats = CommStats()
        self.step = 0
        # values a caller adds to the step's agreement (summed over ranks), e.g. the runner's stop
        # flags: carry() -> [float, ...]; the sums come back in StepResult.carried
        self.carry = None
        self.last: StepResult | None = None   # the last finished step's result
        self.buffers = Buffers(reuse_buffers)
        self._shape = (fusion_bytes, cuda_graph)
        self.pending: dict = {}   # {name: residual of a layer that went dense}, added to its next gradient
        policy.setup(layers, comm.size, network)
        self.buckets = self._build(layers, fusion_bytes, cuda_graph)                                  # 1.
        policy.start_budget(layers, sum(b.control_bytes for b in self.buckets))
        self._wire()
        self.state = StepState()
        self._density_key = None
        redecide.start(self)   # policy.mode cost_model: per-bucket verdicts, checked while training

    def _wire(self) -> None:
        """What ``submit`` and ``finish`` read of the buckets."""
        self.bucket_of = {n: b for b in self.buckets for n in b.names}
        self.planned = [b for b in self.buckets if b.kind == "planned"]
        scatter = [b for b in self.buckets if b.kind == "scatter"]
        # finish() order: the reduce buckets, the scatter group, the gathered ones, the reduce buckets
        # that rode in an allgather (they sum what it brought)
        reduce = [b for b in self.buckets if b.kind == "reduce"]
        self.finishing = [b for b in reduce if b.ride is None] + \
            ([ScatterGroup(scatter, self.comm, self.stats)] if scatter else []) + \
            [b for b in self.buckets if b.kind in ("gather", "planned")] + [b for b in reduce if b.ride is not None]
        # blocking buckets are compressed in finish(), in the order their last layer registered
        self.blocking = sorted((b for b in self.buckets if getattr(b, "blocking", False)),
                               key=lambda b: max(l.index for l in b.layers))
        self.carrier = next((b for b in self.buckets if b.kind == "reduce"), None)

    # -- 1. the buckets, each with its route -----------------------------------------------------
    def _build(self, layers: list, fusion_bytes: int, cuda_graph: str) -> list:
        """Fixed buckets (``core/layout.py``, the partition the cost model prices), one compressor and
        one collective each: compressed allgather layers, compressed allreduce layers, dense layers."""
        def travels(i: int, compressed: bool, collective: str) -> bool:
            return layers[i].compressed == compressed and self._compressor_of(layers[i]).collective == collective
        out: list = []
        for compressed, collective in ((True, "allgather"), (True, "allreduce"), (False, "allreduce")):
            parts = layout.buckets([l.numel for l in layers], fusion_bytes,
                                   include=lambda i, c=compressed, k=collective: travels(i, c, k))
            for part in parts:
                group = tuple(layers[j] for j in part)
                out.append(self._bucket(len(out), group, collective, cuda_graph, first_reduce=not any(
                    b.kind == "reduce" for b in out)))
        self._seat_riders(out)
        return out

    def _seat_riders(self, buckets: list) -> None:
        """``policy.dense_in_gather_bytes``: where the dense layers' bytes fit, their reduce buckets
        ride in the allgather of the gather bucket whose first layer comes in last (in backward, the
        one that starts last anyway), so the step has one collective round fewer. auto: the bytes
        one round's latency buys on the network the policy planned for (``costmodel.ride_cap``)."""
        cap = self.policy.config.policy.dense_in_gather_bytes
        if cap == "auto":
            cap = int(ride_cap(self.policy.network or Network.from_config()))
        dense = [b for b in buckets if b.kind == "reduce" and not b.layers[0].compressed]
        hosts = [b for b in buckets if b.kind == "gather"]
        nbytes = (2 if self.dense_fp16 else 4) * sum(l.numel for b in dense for l in b.layers)
        if not (cap and dense and hosts) or nbytes > cap or self.comm.size < 2:
            return
        host = min(hosts, key=lambda b: min(l.index for l in b.layers))
        for bucket in dense:
            host.take_rider(bucket)
        note = (f"policy.dense_in_gather_bytes: the dense layers' {nbytes} bytes ride in the compressed layers' "
                f"allgather (at most {cap}): one collective round a step fewer")
        if note not in self.policy.notes:
            self.policy.notes.append(note)

    def _compressor_of(self, layer: Layer) -> Compressor:
        return self.compressor if layer.compressed else self.dense

    def _bucket(self, index: int, group: tuple, collective: str, cuda_graph: str, first_reduce: bool):
        compressed = group[0].compressed
        comp = self._compressor_of(group[0])
        memory = self.memory if compressed else NoMemory()
        # a step that passes NaN on (check_finite off) must know its layers too: evidence either way
        common = dict(evidence=not comp.checks_finite and (compressed or self.dense_fp16), clip=self.clip)
        args = (index, group, comp, memory, self.comm, self.stats, self.policy, self.buffers)
        if collective == "allreduce":
            return ReduceBucket(*args, carrier=first_reduce, passthrough=comp.passthrough,
                                momentum=not compressed and self.memory.corrects_momentum, **common)
        aggregation = self.policy.aggregation(group)
        if aggregation == "sparse_reduce_scatter":
            return ScatterBucket(*args, together=comp.selects_by_bucket(list(group)), **common)
        terms = self.memory.flat_terms([l.name for l in group]) if comp.flat is not None else None
        if terms is not None:   # its residuals (and velocities) a flat block of the memory's state
            keeps = terms.pop("residual")
            return PlannedBucket(*args[:3], memory if keeps else None, *args[4:], terms=terms, clip=self.clip,
                                 graphs=cuda_graph)
        return GatherBucket(*args, together=comp.selects_by_bucket(list(group)), **common)

    def grad_buffers(self, dtype: torch.dtype, device) -> dict:
        """{name: flat view} where gradients should land: the planned buckets' gradient buffers and,
        for fp32, the dense reduce buckets' fused buffers. An adapter that makes these views the
        parameters' ``.grad`` saves the step a copy per layer (DDP's buckets do the same); a
        gradient elsewhere is copied in."""
        out: dict = {}
        for bucket in self.planned:
            out.update(bucket.gradient_views(dtype, device))
        if dtype == torch.float32 and self.buffers.keep and not self.dense_fp16:
            for b in self.buckets:
                if b.kind == "reduce" and not b.layers[0].compressed:
                    out.update(b.gradient_views(device))
        return out

    def use_grad_scaler(self, scaler) -> None:
        """Gradients arrive multiplied by ``scaler``'s scale (``torch.amp.GradScaler``, fp16).

        1. each step, with its first gradient, the scale is taken as a device tensor
           (``scaler.scale(1)``: no host read); the buckets divide by it, so residuals and the
           wire hold unscaled values;
        2. the averages are multiplied by it again, so the scaler's ``unscale_`` is right;
        3. an overflow (inf/NaN on any rank) rolls the memories back and returns inf-filled
           gradients (``on_nonfinite="skip"``): the scaler skips the step and lowers its scale.
        """
        if not scaler.is_enabled():
            return   # it scales nothing
        if self.check_finite_unset:
            self.check_finite = True   # the check is how an overflowing step is skipped
        if not self.check_finite:
            raise ValueError("a GradScaler skips the steps whose gradients overflow, and the exchange must roll "
                             "its residuals back on those steps: set compression.check_finite: true (or leave it "
                             "unset)")
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

    # -- 2. per layer, from the hook -----------------------------------------------------------
    def submit(self, name: str, grad: torch.Tensor) -> None:
        layer, st = self.layers[name], self.state
        if name in st.submitted:
            raise RuntimeError(f"gradient of {name!r} submitted twice in one step; call step() or "
                               "synchronize() between backward passes, or raise backward_passes_per_step")
        if not st.submitted:   # the step's first gradient
            self._set_densities()
            st.observe = self.policy.observes(self.step)
            if self.scaler is not None:
                st.grad_scale = self.scaler.scale(torch.ones((), device=grad.device))
            if self.lr_of is not None:
                self.follow_lr(self.lr_of())
            if self.carry is not None:
                st.carry = [float(v) for v in self.carry()]
        st.submitted.add(name)
        if name in self.pending:   # what it kept back while it travelled compressed
            grad = grad.reshape(-1).float() + self.pending.pop(name).to(grad.device)
        self._call(self.bucket_of[name], "add", layer, grad, st)

    def _call(self, bucket, call: str, *args):
        """``bucket.<call>(*args)``, timed for the cost model's review where one runs."""
        if getattr(self.policy, "review", None) is None:
            return getattr(bucket, call)(*args)
        return redecide.timed(self.policy.review, bucket, call, *args)

    def _set_densities(self) -> None:
        """Each layer's density for this step (``LayerPolicy.density``), set again only where the
        policy's layout key says some may have changed (a warm-up stage, a budget's choice)."""
        key = self.state.layout = self.policy.layout_key(self.step)
        if key != self._density_key:
            for layer in self.layers.values():
                layer.density = self.policy.density(layer, self.step)
            self._density_key = key

    # -- 3. per step ---------------------------------------------------------------------------
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
        apply = apply or {}
        try:
            for bucket in self.blocking:
                self._call(bucket, "flush", self.state)
            carry = self._start_carry()
            arrived = []
            for bucket in self.finishing:
                arrived.append(self._call(bucket, "finish", into or {}, apply))
            out = {n: t for a in arrived for n, t in a.averages.items()}
            bad, carried = self._read(carry, arrived)
            passed = bad and not self.check_finite and not self.state.vetoed
            if (bad or self.state.vetoed) and not passed:
                return nonfinite.fail(self, out, carried)   # raises, or (on_nonfinite="skip") rolls back
            if passed:
                nonfinite.pass_on(self, out, apply)
            applied = self._after_average(arrived, out, apply)
        except BaseException:
            self.abort()
            raise
        self._settle(commit=True, passed=passed)
        self.stats.add_bytes(self.policy.after_step(self.step, self.comm))   # policy.mode budget: may choose
        self.stats.end_step()
        self.step += 1
        self.state = StepState(step=self.step)
        self.last = StepResult(out, applied, carried)
        redecide.after_step(self)   # policy.mode cost_model: a window's measurements, agreed
        return self.last

    def _start_carry(self):
        """Where no reduce bucket carries the caller's carry values (every layer travels by
        allgather), one tiny allreduce of them; None otherwise (the usual case)."""
        if self.state.carry is None or self.carrier is not None:
            return None
        self.stats.add_bytes({"scalars": 4})   # the carried values are the caller's traffic, not compression's
        return self.comm.allreduce_async(torch.tensor(self.state.carry, dtype=torch.float32), name="rsync.carry",
                                         average=False)

    def _read(self, carry, arrived: list) -> tuple[bool, list | None]:
        """The step's one host read: every bucket's count of non-finite inputs and the carried sums,
        gathered on one device first. Returns (any non-finite, carried sums or None)."""
        counts = [a.flags for a in arrived if a.flags is not None]   # with check_finite off too: NaN passes on
        carried = next((a.carried for a in arrived if a.carried is not None), None)
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

    def veto(self, names: list) -> None:
        """Fail this step as a non-finite one, for inputs the caller exchanged itself and found
        NaN/Inf in (the torch adapter's sparse gradients): ``finish`` then rolls back and raises
        (or, with a GradScaler, skips) as for the exchange's own. Every rank must veto alike: call
        it with what every rank received, not with this rank's own inputs."""
        self.state.vetoed = list(names)

    def _after_average(self, arrived: list, out: dict, apply: dict) -> list:
        """What needs the checked average: DGC momentum of dense layers, the GradScaler's scale, and
        (last: nothing after it may fail, the weights change) sparse updates. Returns the applied
        layers."""
        momentum = [n for a in arrived for n in a.momentum]
        if momentum:
            with self.stats.timer("decompress", "allreduce"):
                self.memory.dense_momentum(momentum, [out[n] for n in momentum])
        if self.state.grad_scale is not None:
            for t in out.values():
                t.mul_(self.state.grad_scale)   # the caller's GradScaler unscales them again
        updates = [u for a in arrived for u in a.updates]
        if updates:
            with self.stats.timer("decompress", "allgather"):
                for layer, tensors, alpha in updates:
                    self.compressor.decompress_add(apply[layer.name][0], tensors, layer, alpha=alpha)
        return sorted({layer.name for layer, _, _ in updates})

    def _settle(self, commit: bool, passed: bool = False) -> None:
        """Every memory and the compressor's state keep this step (commit) or forget it. A step that
        passed NaN on keeps the memories with what is not finite zeroed, and the compressor's state
        (PowerSGD's warm Q) as it was."""
        if passed:
            self.memory.keep_finite()
        if commit:
            self.memory.commit()
        else:
            self.memory.rollback()
        if commit and not passed:
            self.compressor.commit()
        else:
            self.compressor.rollback()
        for bucket in self.buckets:
            bucket.clear()

    def abort(self) -> None:
        """Drop this step: the memories (and the compressor's state) roll back, the step's figures
        are discarded."""
        self._settle(commit=False)
        self.state = StepState(step=self.step)
        self.stats.step.clear()

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
        return [f"bucket {b.index} ({len(b.layers)} layers, {sum(b.frame.sizes)} elements): exact-k plan, {b.path}"
                for b in self.planned]

    def decision_record(self) -> dict:
        """The decisions with the figures they were made from (``LayerPolicy.record``): what a
        run folder's decisions.json and a checkpoint keep, and ``policy.decisions`` pins."""
        return self.policy.record()

    def set_steps_per_epoch(self, steps: int) -> None:
        """Needed by epoch-based schedules such as ``warmup.epochs``."""
        self.policy.steps_per_epoch = int(steps)
        self._density_key = None

    def residuals(self, kind: str = "residual") -> dict:
        """{name: this rank's current residual} of every compressed layer that keeps one (``kind``
        "velocity": DGC's velocities), wherever it lives (the memory, or a planned bucket)."""
        return self.memory.residuals(kind)

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "memory": self.memory.state_dict(), "compressor": self.compressor.state_dict(),
                "stats": self.stats.state_dict(), "lr": self.lr, "policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.state = StepState(step=self.step)
        self.lr = state.get("lr")
        if state.get("memory"):
            self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state.get("compressor", {}))
        if "stats" in state:
            self.stats.load_state_dict(state["stats"])
        if state.get("policy"):
            self.policy.load_state_dict(state["policy"])
        self._density_key = None
