"""The gradient exchange: memory -> compressor -> communicator -> decompress, per layer.

Framework-neutral (torch tensors in, torch tensors out); the PyTorch optimizer
feeds it from gradient hooks, so compression and communication of early-ready
layers overlap the rest of the backward pass.

Per step:
  submit(name, grad)   from a hook: check, compensate with the residual, compress,
                       subtract what was sent, and start the collective
                       (dense layers: one named allreduce each, fused by Horovod;
                       sparse layers: packed into fixed buckets, one allgather
                       per bucket as soon as all its layers are in);
  finish()             wait, decode, average; agree across ranks that every
                       gradient was finite; only then commit the residuals.
"""
from __future__ import annotations

import torch

from .comm.packing import pack, unpack_gathered
from .compressors.base import Compressor, Layer
from .compressors.dense import NoneCompressor
from .core.stats import CommStats


class NonFiniteGradientError(FloatingPointError):
    pass


class _Bucket:
    def __init__(self, index: int, layers: list):
        self.index = index
        self.layers = layers
        self.messages: dict = {}
        self.handles = None


class GradientExchange:
    def __init__(self, layers: list, compressor: Compressor, comm, policy, memory=None,
                 check_finite: bool = True, fusion_bytes: int = 16 << 20, clip_norm: float | None = None,
                 network=None):
        self.layers = {l.name: l for l in layers}
        self.order = [l.name for l in layers]
        self.compressor = compressor
        if hasattr(compressor, "comm") and compressor.comm is None:
            compressor.comm = comm   # compressors that run their own collectives (IWP's broadcast)
        self.dense = NoneCompressor()
        self.comm = comm
        self.policy = policy
        self.memory = memory
        self.check_finite = check_finite
        self.stats = CommStats()
        self.step = 0
        # DGC's local clipping: each worker's share of the global norm budget is N**-0.5
        self.clip = clip_norm * comm.size ** -0.5 if clip_norm else None
        for layer in layers:
            if layer.numel == 0:
                raise ValueError(f"parameter {layer.name!r} has zero elements: there is nothing to exchange. "
                                 "Remove it from named_parameters or set requires_grad=False")
        policy.setup(layers, comm.size, network)
        self._buckets, self._bucket_of = self._make_buckets(layers, fusion_bytes)
        self._reset_step()

    # -- setup ---------------------------------------------------------------
    def _make_buckets(self, layers, fusion_bytes):
        """Fixed partition of allgather layers, in reverse registration order (the
        order backward produces gradients), so every rank builds identical buckets."""
        if self.compressor.collective != "allgather":
            return [], {}
        buckets, current, size = [], [], 0
        for layer in reversed(layers):
            if not layer.compressed:
                continue
            if current and size + 4 * layer.numel > fusion_bytes:
                buckets.append(_Bucket(len(buckets), current))
                current, size = [], 0
            current.append(layer)
            size += 4 * layer.numel
        if current:
            buckets.append(_Bucket(len(buckets), current))
        return buckets, {l.name: b for b in buckets for l in b.layers}

    def _reset_step(self):
        self._submitted: dict = {}
        self._deferred: dict = {}
        self._dense_handles: dict = {}
        self._bad: list = []
        for b in self._buckets:
            b.messages, b.handles = {}, None

    def compressor_for(self, layer: Layer) -> Compressor:
        return self.compressor if layer.compressed else self.dense

    # -- per layer, from the hook --------------------------------------------
    def submit(self, name: str, grad: torch.Tensor) -> None:
        layer = self.layers[name]
        if name in self._submitted:
            raise RuntimeError(f"gradient of {name!r} submitted twice in one step; call step() or "
                               "synchronize() between backward passes, or raise backward_passes_per_step")
        self._submitted[name] = True
        comp = self.compressor_for(layer)
        if getattr(comp, "blocking", False) and layer.compressed:
            # compressors that wait on a collective inside compress (IWP's broadcast) run in the
            # fixed layer order in finish(): waiting inside a hook could deadlock ranks whose
            # backward passes produce gradients in different orders
            self._deferred[name] = grad
            return
        self._process(name, grad)

    def _process(self, name: str, grad: torch.Tensor) -> None:
        layer = self.layers[name]
        layer.density = self.policy.density(layer, self.step)
        comp = self.compressor_for(layer)
        group = "sparse" if layer.compressed else "dense"
        with self.stats.timer("select", group):
            flat = grad.detach().reshape(-1).float()
            if self.check_finite and not bool(torch.isfinite(flat.sum())):
                # keep the residual clean: communicate zeros, fail on every rank in finish()
                self._bad.append(name)
                flat = torch.zeros_like(flat)
            if self.clip is not None:
                norm = float(flat.norm())
                if norm > self.clip:
                    flat = flat * (self.clip / norm)
            use_memory = self.memory is not None and (layer.compressed or self.memory.applies_to_dense)
            x = self.memory.compensate(name, flat) if use_memory else flat
            msg = comp.compress(x, layer, self.step)
            if use_memory:
                comp.decompress_add(x, msg.tensors, layer, alpha=-1.0)  # x is now the new residual
                if layer.compressed:
                    self.memory.mask(name, comp.sent_indices(msg, layer))
        wire = msg.nbytes()
        self.stats.add_bytes(wire, "sparse" if layer.compressed else "dense")
        self.stats.add("dense_bytes", 4 * layer.numel)
        if msg.selected is not None:
            self.stats.add("selected", msg.selected)
            self.stats.add("k", msg.k)
            self.stats.add(f"selected[{layer.name}]", msg.selected)
            self.stats.add(f"k[{layer.name}]", msg.k)
        self.stats.layer(name, "sparse" if layer.compressed else "dense", msg.selected, msg.k,
                         sum(wire.values()), 4 * layer.numel)
        if comp.collective == "allreduce":
            self._dense_handles[name] = [self.comm.allreduce_async(t, name=f"rsync.{name}.{i}")
                                         for i, t in enumerate(msg.tensors)]
        else:
            bucket = self._bucket_of[name]
            bucket.messages[name] = msg
            if len(bucket.messages) == len(bucket.layers):
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        tensors = [t for l in bucket.layers for t in bucket.messages[l.name].tensors]
        header, payload = pack(tensors, device=bucket.layers[0].device)
        self.stats.add_bytes({"headers": header.numel() * 4})
        bucket.handles = (self.comm.allgather_async(header, name=f"rsync.bucket{bucket.index}.hdr"),
                          self.comm.allgather_async(payload, name=f"rsync.bucket{bucket.index}.data"))

    # -- per step ------------------------------------------------------------
    def missing(self) -> list:
        return [n for n in self.order if n not in self._submitted]

    def finish(self) -> dict:
        """Wait for every collective; return {name: averaged flat gradient}."""
        missing = self.missing()
        if missing:
            raise RuntimeError(f"finish() before gradients of {missing[:5]} were submitted")
        try:
            for name in [n for n in self.order if n in self._deferred]:
                self._process(name, self._deferred.pop(name))
            flag = None
            if self.check_finite:
                flag = self.comm.allreduce_async(torch.tensor([float(len(self._bad))]), name="rsync.finite",
                                                 average=False)
                self.stats.add_bytes({"scalars": 4})
            out = self._collect()
            if flag is not None and float(self.comm.wait(flag)[0]) > 0:
                raise NonFiniteGradientError(
                    f"non-finite gradient (NaN/Inf) at step {self.step}"
                    + (f" in {self._bad[:5]} on this rank" if self._bad else " on another rank")
                    + ". No update was applied and the residuals were left as they were. "
                      "Lower the learning rate, clip gradients, or check the input data; "
                      "compression.check_finite=false disables this check.")
        except BaseException:
            if self.memory is not None:
                self.memory.rollback()
            self._reset_step()
            self.stats.step.clear()
            raise
        if self.memory is not None:
            self.memory.commit()
        self.stats.end_step()
        self.step += 1
        self._reset_step()
        return out

    def _collect(self) -> dict:
        out = {}
        size = self.comm.size
        # waiting and decoding are timed per collective: "allreduce" (dense layers, and the values
        # of allreduce-based methods) and "allgather" (variable-size sparse messages)
        with self.stats.timer("communicate", "allreduce"):
            reduced = {n: [self.comm.wait(h) for h in hs] for n, hs in self._dense_handles.items()}
        with self.stats.timer("communicate", "allgather"):
            gathered = [(b, self.comm.wait(b.handles[0]), self.comm.wait(b.handles[1])) for b in self._buckets]
        with self.stats.timer("decompress", "allreduce"):
            for name, tensors in reduced.items():
                layer = self.layers[name]
                buf = torch.zeros(layer.numel, dtype=torch.float32, device=tensors[0].device)
                self.compressor_for(layer).decompress_add(buf, tensors, layer)
                out[name] = buf
        with self.stats.timer("decompress", "allgather"):
            for bucket, header, payload in gathered:
                dtypes = [d for l in bucket.layers for d in self.compressor.wire_dtypes(l)]
                per_rank = unpack_gathered(header, payload, dtypes, size)
                bufs = {l.name: torch.zeros(l.numel, dtype=torch.float32, device=l.device) for l in bucket.layers}
                for tensors in per_rank:
                    pos = 0
                    for layer in bucket.layers:
                        n = len(self.compressor.wire_dtypes(layer))
                        self.compressor.decompress_add(bufs[layer.name], tensors[pos:pos + n], layer)
                        pos += n
                for name, buf in bufs.items():
                    out[name] = buf.div_(size)
        return out

    # -- checkpointing -------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "memory": self.memory.state_dict() if self.memory is not None else None,
            "compressor": self.compressor.state_dict(),
            "stats": self.stats.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        if self.memory is not None and state.get("memory") is not None:
            self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state.get("compressor", {}))
        if "stats" in state:
            self.stats.load_state_dict(state["stats"])
