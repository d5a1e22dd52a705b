"""Layer-wise policy: which layers are compressed, with which selection, at what density, per step.

* Small layers (biases, norms) cost more in latency and selection than they save in bytes:
  below ``policy.min_compress_numel`` they go dense through Horovod's fused allreduce.
* ``policy.layers`` overrides match parameter names (fnmatch); the first match wins.
* Warm-up (DGC): density decays exponentially from ``warmup.start_density`` to ``density`` in
  ``warmup.stages`` equal stages over ``warmup.steps`` (or ``warmup.epochs``), e.g. 25%,
  6.25%, 1.56%, 0.4%, then 0.1%.
* ``policy.mode: cost_model`` compresses a layer only when the alpha-beta model predicts
  select + allgather + decompress below its share of the fused dense allreduce (the bandwidth
  term: Horovod fuses dense layers, so they share one latency; see costmodel.py).
* ``policy.mode: budget`` chooses each compressed layer's density under one byte budget per
  step, again every ``budget.every`` steps, from statistics of the compensated gradients
  (budget.py): ``observe`` and ``after_step`` are the exchange's two calls into it, ``density``
  stays the one source of each layer's k (the warm-up ramps to the chosen density).
* Pinned decisions (``policy.decisions``, or a checkpoint's on resume): which layers are
  compressed is read from an earlier run's record instead of decided again; densities and
  selections still follow the config (a budget starts from the record's last choice).
* ``aggregation: auto``: per bucket, the allgather or the sparse reduce-scatter, whichever the
  cost model predicts faster (:meth:`LayerPolicy.aggregation`), recorded with each layer.

:meth:`LayerPolicy.record` is what a run folder's ``decisions.json`` and a checkpoint hold:
the decisions and the figures they came from, so a later run can pin them.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math

from ..config.compression import CompressionConfig
from .allocate import density_of, message_cost
from .budget import Budget
from .costmodel import Network, choose_aggregation, fused_dense_share, predict_message, scatter_format


class LayerPolicy:
    """``compressor``: what the layers compressed by the method send (its ``wire``), which the cost
    model and the byte budget price; None where neither runs (``policy.mode: static``)."""

    def __init__(self, config: CompressionConfig, compressor=None):
        self.config, self.compressor = config, compressor
        self.steps_per_epoch: int | None = None
        self.decisions: list[dict] = []
        self.compute = None   # costmodel.ComputeModel; None: the model's default figures
        self.network = None   # costmodel.Network the cost model planned for (None: static policy)
        self.pinned: dict | None = None   # {layer name: decision} of an earlier run, see pin()
        self.pinned_record: dict | None = None
        self.source = "config"            # where the decisions came from: config | cost model | pinned ...
        self.size = 1
        self.budget: Budget | None = None  # policy.mode: budget
        self.notes: list[str] = []        # what the engine changed of the config, and why (layers.log)
        self.review = None   # policy.mode: cost_model: review.Review, the per-bucket verdicts (the exchange's)
        self.overlap = None  # policy.mode: cost_model: the probed fraction of a dense allreduce backward hides

    def _override(self, name: str):
        for o in self.config.policy.layers:
            if fnmatch.fnmatchcase(name, o.pattern):
                return o
        return None

    def pin(self, record: dict, source: str) -> None:
        """Take which layers are compressed from ``record`` (a :meth:`record` of an earlier run)."""
        self.pinned = {d["name"]: d for d in record.get("layers", [])}
        self.pinned_record = record
        self.source = f"pinned: {source}"

    def setup(self, layers: list, size: int = 1, network=None) -> None:
        """Decide once, before the first step, how each layer travels."""
        p = self.config.policy
        self.decisions, self.network, self.size = [], network, size
        if self.pinned is not None:
            self._check_pinned(layers)
        elif p.mode == "cost_model" and network is not None:
            self.source = "cost model"
        for layer in layers:
            o = self._override(layer.name)
            layer.base_density = o.density if o is not None and o.density is not None else self.config.layer_density()
            layer.selection = o.selection if o is not None else None
            layer.quantize = o.quantize if o is not None else None
            layer.compressed, reason = True, "compressed"
            if self.pinned is not None:
                why = str(self.pinned[layer.name].get("why", ""))
                layer.compressed = bool(self.pinned[layer.name]["compressed"])
                reason = why if why.startswith("pinned") else f"pinned ({why})"
            elif o is not None and o.dense:
                layer.compressed, reason = False, f"dense by layers[{o.pattern!r}]"
            elif layer.numel < p.min_compress_numel:
                layer.compressed, reason = False, f"numel {layer.numel} < min_compress_numel"
            elif p.mode == "cost_model" and network is not None:
                layer.compressed, reason = self._pays(layer, size, network)
            self.decisions.append({"name": layer.name, "numel": layer.numel, "compressed": layer.compressed,
                                   "density": layer.base_density if layer.compressed else 1.0, "why": reason,
                                   **self._message(layer)})

    def start_budget(self, layers: list, control_bytes: int) -> None:
        """``policy.mode: budget``: share the byte budget between the compressed layers, once the
        exchange knows its buckets (``control_bytes``: what they send besides the messages, each
        bucket's count of non-finite layers)."""
        if self.config.policy.mode != "budget":
            return
        overrides = {l.name: self._override(l.name) for l in layers}
        own = {n: o.density for n, o in overrides.items() if o is not None and o.density is not None}
        messages = {l.name: self._message_cost(l) for l in layers if l.compressed}
        self.budget = Budget(self.config, layers, own, self.warmup_steps, self.pinned_record, messages,
                             control_bytes)
        self._note_budget()

    def _wire(self, layer, density: float):
        """What the compressor sends for ``layer`` at ``density``."""
        if self.compressor is None:
            raise ValueError("LayerPolicy: pricing layers (policy.mode cost_model or budget, aggregation auto) needs "
                             "the compressor: LayerPolicy(config, compressor)")
        return self.compressor.wire(dataclasses.replace(layer, density=density))

    def _message_cost(self, layer) -> tuple:
        """(the layer's message bytes as a line in k, whether it is one sign and one mean)."""
        def bytes_at(k: int) -> float:
            return self._wire(layer, density_of(layer.numel, k)).nbytes(self.size)
        wire = self._wire(layer, layer.base_density)
        return message_cost(bytes_at), wire.kinds[-1] == "scalars" and wire.counts[-1] == 1

    def _message(self, layer) -> dict:
        """A compressed layer's message format where the method has a choice (RedSync, SBC)."""
        message = getattr(self.config, "message", None)
        if not layer.compressed or not hasattr(message, "quantize"):
            return {}
        return {"quantize": layer.quantize or message.quantize}

    def _check_pinned(self, layers: list) -> None:
        mine = {l.name: l.numel for l in layers}
        theirs = {n: int(d.get("numel", -1)) for n, d in self.pinned.items()}
        if mine != theirs:
            lacking, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
            sizes = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
            raise ValueError(f"compression.policy.decisions ({self.source[8:]}) is for another model: layers "
                             f"missing there {lacking[:5]}, layers this model lacks {extra[:5]}, other sizes "
                             f"{sizes[:5]}. Pin the decisions.json of a run of this model, or remove the setting")

    def record(self) -> dict:
        """The decisions and what they were made from, as plain data (decisions.json, checkpoints)."""
        as_dict = lambda obj: None if obj is None else dataclasses.asdict(obj)   # noqa: E731
        out = {"source": self.source, "world_size": self.size, "layers": [dict(d) for d in self.decisions],
               "network": as_dict(self.network), "compute": as_dict(self.compute)}
        if self.budget is not None:
            out["budget"] = self.budget.record()
        if self.notes:
            out["notes"] = list(self.notes)
        if self.review is not None:
            out["review"] = self.review.record()
        return out

    # -- policy.mode: budget (budget.py); nothing for the other modes ---------------------------------
    @property
    def revision(self) -> int | None:
        """Counts the budget's choices (None: the decisions never change after setup)."""
        return None if self.budget is None else self.budget.revision

    @property
    def log_revision(self) -> int | None:
        """Counts what the run folder should log again: a budget's choices, the review's windows."""
        return self.review.windows if self.review is not None else self.revision

    def observe(self, layers, xs: list, step: int, grads: list) -> None:
        """A unit's compensated x and this step's gradients, before compression (the budget
        measures them on its steps)."""
        if self.budget is not None:
            self.budget.observe(layers, xs, step, grads)

    def observes(self, step: int) -> bool:
        """Whether ``observe`` wants this step's compensated x (a planned bucket then runs eagerly)."""
        return self.budget is not None and self.budget.due(step)

    def after_step(self, step: int, comm) -> dict:
        """The step is committed: the budget chooses where it observed; the bytes it sent."""
        if self.budget is None:
            return {}
        sent = self.budget.after_step(step, comm)
        if sent:
            self._note_budget()
        return sent

    def _note_budget(self) -> None:
        last = self.budget.history[-1] if self.budget.history else {"step": 0, "why": "restored"}
        for layer in self.budget.shared:
            d = next(d for d in self.decisions if d["name"] == layer.name)
            d["density"], d["why"] = layer.base_density, f"budget: {last['why']} at step {last['step']}"

    def state_dict(self) -> dict:
        return {} if self.budget is None else {"budget": self.budget.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.budget is not None and state.get("budget"):
            self.budget.load_state_dict(state["budget"])
            self._note_budget()

    def _pays(self, layer, size: int, network) -> tuple[bool, str]:
        """Compress a layer where its marginal cost compressed is below its marginal cost dense: a
        layer rides in a bucket either way (a compressed bucket's allgather, Horovod's fusion buffer),
        whose collective's latency is paid once for all its layers, so both sides are priced
        without it (a compressed layer keeps the fixed cost of its selection and decode, and the
        latency of collectives its compressor runs per layer, IWP's broadcast)."""
        pred = predict_message(layer.numel, self._wire(layer, layer.base_density), self.compressor.collective, size,
                               network, compute=self.compute,
                               aggregation=getattr(self.config, "aggregation", "allgather"), shared=True)
        dense = fused_dense_share(layer.numel, size, network, self.config.policy.dense_values == "fp16")
        return pred.total_s < dense, (f"cost model: compressed {pred.total_s * 1e3:.3f} ms (select "
                                      f"{pred.select_s * 1e3:.3f}) vs dense {dense * 1e3:.3f} ms, both its "
                                      "share of a bucket's collective")

    def aggregation(self, layers) -> str:
        """How one bucket of compressed layers meets (``aggregation``): allgather, the sparse
        reduce-scatter, or for ``auto`` the one the cost model predicts faster for this N, the
        layers' k and the network (a pinned record's choice where it has one). Every rank decides
        alike: the figures are agreed. The choice and why go into the layers' decisions."""
        choice = getattr(self.config, "aggregation", "allgather")
        why = "config"
        pinned = [self.pinned[l.name].get("aggregation") for l in layers] if self.pinned is not None else []
        if choice == "auto" and pinned and None not in pinned and len(set(pinned)) == 1:
            choice, why = pinned[0], "pinned"
        elif choice == "auto":
            choice, why = self._cheaper_path(layers)
        for d in self.decisions:
            if any(d["name"] == l.name for l in layers):
                d["aggregation"], d["aggregation_why"] = choice, why
        return choice

    def _cheaper_path(self, layers) -> tuple[str, str]:
        network, assumed = self.network, ""
        if network is None:
            network, assumed = Network.from_config(), " (assumed network: 25 us, 10 Gbit/s)"
        shapes = [(l.numel, l.base_density, scatter_format(self._wire(l, l.base_density))) for l in layers]
        pick, times = choose_aggregation(shapes, self.size, network, self.compute)
        return pick, (f"cost model: allgather {times['allgather'] * 1e3:.3f} ms, sparse_reduce_scatter "
                      f"{times['sparse_reduce_scatter'] * 1e3:.3f} ms for the bucket at N={self.size}{assumed}")

    def warmup_steps(self) -> int:
        w = self.config.warmup_schedule
        if w is None:
            return 0
        if w.steps:
            return w.steps
        if w.epochs:
            if not self.steps_per_epoch:
                raise ValueError("compression.warmup.epochs needs the number of steps per epoch: call "
                                 "optimizer.set_steps_per_epoch(len(train_loader)), or use warmup.steps")
            return int(round(w.epochs * self.steps_per_epoch))
        return 0

    def layout_key(self, step: int) -> tuple:
        """Changes whenever some layer's density may have (a warm-up stage, a budget's choice):
        what a bucket kept flat builds its layout once for."""
        total = self.warmup_steps()
        stage = math.floor(step / total * self.config.warmup_schedule.stages) if total and step < total else -1
        return stage, self.revision, self._follow_octave(step)

    def _follow_octave(self, step: int) -> int | None:
        """``warmup.min_sends`` c: the quarter octave of c / t at step t = step + 1, or None."""
        w = self.config.warmup_schedule
        if w is None or not w.min_sends:
            return None
        # at most 0 (density 1); no lower than the lowest density set, below which nothing changes
        floor = min([self.config.layer_density()] + [o.density for o in self.config.policy.layers if o.density])
        return min(0, max(math.ceil(4 * math.log2(w.min_sends / (step + 1))), math.floor(4 * math.log2(floor))))

    def density(self, layer, step: int) -> float:
        if not layer.compressed:
            return 1.0
        octave = self._follow_octave(step)   # d_t = max(d, c / t), rounded up: the density follows the run
        follow = 0.0 if octave is None else 2.0 ** (octave / 4)
        final, total = layer.base_density, self.warmup_steps()
        if not total or step >= total:
            return max(final, follow)
        w = self.config.warmup_schedule
        start = max(w.start_density, final)
        frac = math.floor(step / total * w.stages) / w.stages
        return max(start * (final / start) ** frac, follow)
