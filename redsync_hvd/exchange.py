"""The gradient exchange: memory -> compressor -> communicator -> decompress, per layer.

Framework-neutral (torch tensors in, torch tensors out); the PyTorch optimizer
feeds it from gradient hooks, so compression and communication of early-ready
layers overlap the rest of the backward pass.

Per step:
  submit(name, grad)   from a hook: check, compensate with the residual, compress,
                       subtract what was sent, and start the collective
                       (dense layers: one named allreduce each, fused by Horovod;
                       sparse layers: packed into fixed buckets, one allgather
                       per bucket as soon as all its layers are in; with
                       selection by bucket, the bucket's layers are compressed
                       together then, see core/bucket_select.py);
  finish()             wait, decode, average; agree across ranks that every
                       gradient was finite; only then commit the residuals.
"""
from __future__ import annotations

import torch

from .comm.packing import pack, unpack_gathered
from .compressors.base import Compressor, Layer
from .compressors.dense import NoneCompressor
from .core.selection import NonFiniteError
from .core.stats import CommStats


class NonFiniteGradientError(FloatingPointError):
    pass


class _Bucket:
    def __init__(self, index: int, layers: list):
        self.index = index
        self.layers = layers
        self.messages: dict = {}
        self.pending: dict = {}     # selection by bucket: {name: x} until the last layer is in
        self.handles = None
        self.by_bucket = False


class GradientExchange:
    def __init__(self, layers: list, compressor: Compressor, comm, policy, memory=None,
                 check_finite: bool = True, fusion_bytes: int = 16 << 20, clip_norm: float | None = None,
                 network=None, reuse_buffers: bool = True, grads_writable: bool = False):
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
        # Layer-sized buffers that live across steps. A fresh CPU tensor of tens of MB is
        # mmapped and page-faulted in on every step (several times the cost of filling a
        # warm one), so outputs and in-place allreduce buffers are allocated once. finish()'s
        # tensors are then valid until the next step; callers that keep them longer (a TF
        # tensor sharing the memory through DLPack) pass reuse_buffers=False.
        self._out: dict = {}
        self.reuse_buffers = reuse_buffers
        # the caller's gradient tensors may be overwritten (the torch adapter: they are .grad,
        # which the average replaces anyway): dense layers are then reduced in place in them
        self.grads_writable = grads_writable
        if network is not None and policy.compute is None:
            # cost-model decisions need this machine's selection cost (both adapters get it here)
            from .compute_probe import probe_compute
            policy.compute = probe_compute(comm, layers[0].device if layers else "cpu")
        policy.setup(layers, comm.size, network)
        self._buckets, self._bucket_of = self._make_buckets(layers, fusion_bytes)
        self.applied: list = []
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
        for b in buckets:
            b.by_bucket = self.compressor.selects_by_bucket(b.layers)
        return buckets, {l.name: b for b in buckets for l in b.layers}

    def _reset_step(self):
        self._submitted: dict = {}
        self._deferred: dict = {}
        self._dense_handles: dict = {}
        self._bad: list = []
        self._sums: list = []
        self._momentum_after: list = []
        self._updates: list = []
        self._into: dict = {}
        self._apply: dict = {}
        for b in self._buckets:
            b.messages, b.pending, b.handles = {}, {}, None

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
        use_memory = self.memory is not None and layer.compressed
        bucket = self._bucket_of.get(name) if layer.compressed else None
        with self.stats.timer("select", "sparse" if layer.compressed else "dense"):
            flat = grad.detach().reshape(-1).float()
            # compressors that select from every value check for NaN/Inf in a pass they make
            # anyway; others get one summing pass here, read back once in finish() (a read
            # per layer would stall a GPU once per layer). A NaN may travel meanwhile: every
            # rank then fails the step and rolls its memory back.
            if self.check_finite and not (layer.compressed and comp.checks_finite):
                self._sums.append((name, flat.sum()))
            if self.clip is not None:
                norm = float(flat.norm())
                if norm > self.clip:
                    flat = flat * (self.clip / norm)
            if not layer.compressed and hasattr(self.memory, "dense_momentum"):
                self._momentum_after.append(name)   # momentum correction: applied to the average
            if bucket is not None and bucket.by_bucket:
                # selected with the rest of its bucket once the last layer is in (GPU: the
                # hook queues work and never waits for the device)
                bucket.pending[name] = self.memory.compensate(name, flat) if use_memory else flat
                if len(bucket.pending) < len(bucket.layers):
                    return
                xs = [bucket.pending[l.name] for l in bucket.layers]
                messages, bad = comp.compress_bucket(xs, bucket.layers, self.step)
                if bad and not self.check_finite:
                    raise NonFiniteError(f"non-finite gradient values in {bad[:5]} (NaN or Inf): refusing "
                                         "to select")
                self._bad += bad    # sent empty; every rank fails the step in finish()
                done = list(zip(bucket.layers, xs, messages))
            else:
                scan = comp.scan_request(layer, self.step) if use_memory else None
                x = self.memory.compensate(name, flat, scan=scan) if use_memory else flat
                try:
                    msg = comp.compress(x, layer, self.step)
                except NonFiniteError:
                    if not self.check_finite:
                        raise
                    flat = self._mark_bad(name, flat)
                    x = self.memory.compensate(name, flat) if use_memory else flat
                    msg = comp.compress(x, layer, self.step)
                done = [(layer, x, msg)]
            for lay, x, msg in done:
                self._subtract_sent(lay, comp, x, msg, use_memory)
        for lay, _, msg in done:
            self._start(lay, comp, msg)

    def _subtract_sent(self, layer: Layer, comp: Compressor, x: torch.Tensor, msg, use_memory: bool) -> None:
        name = layer.name
        if comp.collective == "allreduce" and hasattr(self.comm, "allreduce_async_"):
            # allreduce in place on a buffer of ours: no output allocation per step, and
            # the message no longer aliases x, which the memory update below overwrites
            msg.tensors = [t if self.grads_writable and not use_memory and t is x
                           else self._owned(f"{name}.{i}", t) for i, t in enumerate(msg.tensors)]
        elif use_memory:
            msg.tensors = [self._owned(f"{name}.{i}", t) if _aliases(t, x) else t for i, t in enumerate(msg.tensors)]
        if use_memory:
            comp.decompress_add(x, msg.tensors, layer, alpha=-1.0)  # x is now the new residual
            if layer.compressed:
                self.memory.mask(name, comp.sent_indices(msg, layer))

    def _start(self, layer: Layer, comp: Compressor, msg) -> None:
        name = layer.name
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
            start = getattr(self.comm, "allreduce_async_", self.comm.allreduce_async)
            self._dense_handles[name] = [start(t, name=f"rsync.{name}.{i}") for i, t in enumerate(msg.tensors)]
        else:
            bucket = self._bucket_of[name]
            bucket.messages[name] = msg
            if len(bucket.messages) == len(bucket.layers):
                self._launch(bucket)

    def _mark_bad(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """Keep the residual clean: communicate zeros, fail on every rank in finish()."""
        self._bad.append(name)
        return torch.zeros_like(flat)

    def _owned(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._out.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = torch.empty_like(t)
            if self.reuse_buffers:
                self._out[key] = buf
        return buf.copy_(t)

    def _zeroed(self, layer: Layer, device) -> torch.Tensor:
        into = self._into.get(layer.name)
        if into is not None and into.device == torch.device(device):
            return into.zero_()
        buf = self._out.get(layer.name)
        if buf is None or buf.device != torch.device(device):
            buf = torch.empty(layer.numel, dtype=torch.float32, device=device)
            if self.reuse_buffers:
                self._out[layer.name] = buf
        return buf.zero_()

    def _launch(self, bucket: _Bucket) -> None:
        tensors = [t for l in bucket.layers for t in bucket.messages[l.name].tensors]
        header, payload = pack(tensors, device=bucket.layers[0].device)
        self.stats.add_bytes({"headers": header.numel() * 4})
        bucket.handles = (self.comm.allgather_async(header, name=f"rsync.bucket{bucket.index}.hdr"),
                          self.comm.allgather_async(payload, name=f"rsync.bucket{bucket.index}.data"))

    # -- per step ------------------------------------------------------------
    def missing(self) -> list:
        return [n for n in self.order if n not in self._submitted]

    def finish(self, into: dict | None = None, apply: dict | None = None) -> dict:
        """Wait for every collective; return {name: averaged flat gradient}.

        ``into``: optional {name: flat float32 tensor} to decode sparse layers into (the
        torch adapter passes the .grad tensors, saving a copy); the result then is that tensor.
        ``apply``: optional {name: (flat float32 parameter, lr)}: a layer among these that
        travelled sparse by allgather is decoded straight into its parameter as
        p -= lr * average (a plain SGD step), once every check has passed, and is left out
        of the result (``self.applied`` lists them). No dense gradient is written for it.
        """
        self._into = into or {}
        self._apply = apply or {}
        self.applied = []
        missing = self.missing()
        if missing:
            raise RuntimeError(f"finish() before gradients of {missing[:5]} were submitted")
        try:
            for name in [n for n in self.order if n in self._deferred]:
                self._process(name, self._deferred.pop(name))
            flag = None
            if self._sums:
                sums = torch.stack([v for _, v in self._sums])
                if not bool(torch.isfinite(sums).all()):
                    ok = torch.isfinite(sums).tolist()
                    self._bad += [n for (n, _), good in zip(self._sums, ok) if not good]
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
            if self._momentum_after:
                with self.stats.timer("decompress", "allreduce"):
                    self.memory.dense_momentum(self._momentum_after, [out[n] for n in self._momentum_after])
            if self._updates:   # last: nothing after this may fail, the weights have changed
                with self.stats.timer("decompress", "allgather"):
                    for layer, tensors, alpha in self._updates:
                        self.compressor.decompress_add(self._apply[layer.name][0], tensors, layer, alpha=alpha)
                self.applied = sorted({layer.name for layer, _, _ in self._updates})
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
                comp = self.compressor_for(layer)
                if type(comp) is NoneCompressor and tensors[0].dtype == torch.float32:
                    out[name] = tensors[0].reshape(-1)   # already the average: no copy
                    continue
                buf = self._zeroed(layer, tensors[0].device)
                comp.decompress_add(buf, tensors, layer)
                out[name] = buf
        with self.stats.timer("decompress", "allgather"):
            for bucket, header, payload in gathered:
                dtypes = [d for l in bucket.layers for d in self.compressor.wire_dtypes(l)]
                per_rank = unpack_gathered(header, payload, dtypes, size)
                # a power-of-two size scales each term exactly (subnormals aside), so adding
                # v/size equals dividing the sum bit for bit, and saves a pass over every output
                exact_scale = size & (size - 1) == 0
                alpha = 1.0 / size if exact_scale else 1.0
                bufs = {l.name: self._zeroed(l, l.device) for l in bucket.layers if l.name not in self._apply}
                for tensors in per_rank:
                    pos = 0
                    for layer in bucket.layers:
                        n = len(self.compressor.wire_dtypes(layer))
                        part = tensors[pos:pos + n]
                        pos += n
                        if layer.name in self._apply:   # applied to the weights after the checks
                            self._updates.append((layer, part, -self._apply[layer.name][1] / size))
                        else:
                            self.compressor.decompress_add(bufs[layer.name], part, layer, alpha=alpha)
                for name, buf in bufs.items():
                    out[name] = buf if exact_scale else buf.div_(size)
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


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
