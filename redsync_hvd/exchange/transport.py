"""Starting the exchange's collectives, and turning what arrives into averaged gradients.

Dense layers and allreduce methods: one named (in place) allreduce per message tensor; Horovod
fuses concurrent small ones. Allgather methods: each bucket's messages are packed into one
fixed-size header and one byte payload (comm/packing.py) and allgathered as soon as the
bucket's last layer is in, so early buckets overlap the rest of backward.
"""
from __future__ import annotations

import torch

from ..comm.packing import pack, unpack_gathered
from ..compressors.dense import NoneCompressor
from .step import Bucket, StepState


class Transport:
    def __init__(self, comm, stats, layers: dict, buckets: list, reuse_buffers: bool = True):
        self.comm = comm
        self.layers = layers
        self.stats = stats
        self.buckets = buckets
        self.bucket_of = {l.name: b for b in buckets for l in b.layers}
        # Layer-sized buffers that live across steps. A fresh CPU tensor of tens of MB is
        # mmapped and page-faulted in on every step (several times the cost of filling a warm
        # one), so outputs and in-place allreduce buffers are allocated once; finish()'s
        # tensors are then valid until the next step. Callers that keep them longer (a TF
        # tensor sharing the memory through DLPack) pass reuse_buffers=False.
        self.reuse_buffers = reuse_buffers
        self._buffers: dict = {}

    # -- sending ------------------------------------------------------------------------
    def own(self, comp, name: str, x: torch.Tensor, msg, in_place_ok: bool):
        """Before the memory update overwrites x: an in-place allreduce gets buffers of ours (no
        output allocation per step), unless it may reduce the caller's gradient itself."""
        if comp.collective == "allreduce" and hasattr(self.comm, "allreduce_async_"):
            msg.tensors = [t if in_place_ok and t is x else self._owned(f"{name}.{i}", t)
                           for i, t in enumerate(msg.tensors)]
        elif not in_place_ok and any(_aliases(t, x) for t in msg.tensors):
            raise RuntimeError(f"{type(comp).__name__}.compress returned a view of its input for {name!r}: the "
                               "memory update would overwrite the message; return a copy")
        return msg

    def send(self, state: StepState, comp, layer, msg) -> None:
        self._account(layer, msg)
        if comp.collective == "allreduce":
            start = getattr(self.comm, "allreduce_async_", self.comm.allreduce_async)
            state.reduce[layer.name] = ([start(t, name=f"rsync.{layer.name}.{i}") for i, t in enumerate(msg.tensors)],
                                        msg)
            return
        bucket = self.bucket_of[layer.name]
        messages = state.gather.setdefault(bucket.index, {})
        messages[layer.name] = msg
        if len(messages) == len(bucket.layers):
            tensors = [t for l in bucket.layers for t in messages[l.name].tensors]
            header, payload = pack(tensors, device=bucket.layers[0].device)
            self.stats.add_bytes({"headers": header.numel() * 4})
            state.handles[bucket.index] = (
                self.comm.allgather_async(header, name=f"rsync.bucket{bucket.index}.hdr"),
                self.comm.allgather_async(payload, name=f"rsync.bucket{bucket.index}.data"))

    def _account(self, layer, msg) -> None:
        group = "sparse" if layer.compressed else "dense"
        wire = msg.nbytes()
        self.stats.add_bytes(wire, group)
        self.stats.add("dense_bytes", 4 * layer.numel)
        if msg.selected is not None:
            for key, value in (("selected", msg.selected), ("k", msg.k)):
                self.stats.add(key, value)
                self.stats.add(f"{key}[{layer.name}]", value)
        self.stats.layer(layer.name, group, msg.selected, msg.k, sum(wire.values()), 4 * layer.numel)

    # -- receiving ------------------------------------------------------------------------
    def collect(self, state: StepState, compressor_for, into: dict, apply: dict) -> tuple[dict, list]:
        """Wait for every collective and decode: ({name: averaged flat gradient}, sparse updates).

        ``into``: {name: flat fp32 tensor} to decode sparse layers into (saves a copy). ``apply``:
        {name: (flat parameter, lr)}: such allgather layers are not decoded here but returned as
        (layer, tensors, alpha) updates, applied to the weights once every check has passed."""
        with self.stats.timer("communicate", "allreduce"):
            reduced = {n: ([self.comm.wait(h) for h in hs], msg) for n, (hs, msg) in state.reduce.items()}
        with self.stats.timer("communicate", "allgather"):
            gathered = [(b, self.comm.wait(state.handles[b.index][0]), self.comm.wait(state.handles[b.index][1]))
                        for b in self.buckets]
        out: dict = {}
        with self.stats.timer("decompress", "allreduce"):
            for name, (tensors, msg) in reduced.items():
                layer = self.layers[name]
                out[name] = self._decode_reduced(compressor_for(layer), layer, tensors, msg, into)
        updates: list = []
        with self.stats.timer("decompress", "allgather"):
            for bucket, header, payload in gathered:
                self._decode_bucket(compressor_for(bucket.layers[0]), bucket, header, payload, into, apply, out,
                                    updates)
        return out, updates

    def _decode_reduced(self, comp, layer, tensors, msg, into) -> torch.Tensor:
        if type(comp) is NoneCompressor and tensors[0].dtype == torch.float32:
            return tensors[0].reshape(-1)   # already the average: no copy
        buf = self._zeroed(layer, tensors[0].device, into)
        comp.decompress_add(buf, tensors, layer, ctx=msg.ctx)
        return buf

    def _decode_bucket(self, comp, bucket: Bucket, header, payload, into, apply, out, updates) -> None:
        size = self.comm.size
        dtypes = [d for l in bucket.layers for d in comp.wire_dtypes(l)]
        per_rank = unpack_gathered(header, payload, dtypes, size)
        # a power-of-two size scales each term exactly (subnormals aside), so adding v/size
        # equals dividing the sum bit for bit, and saves a pass over every output
        exact_scale = size & (size - 1) == 0
        alpha = 1.0 / size if exact_scale else 1.0
        bufs = {l.name: self._zeroed(l, l.device, into) for l in bucket.layers if l.name not in apply}
        for tensors in per_rank:
            pos = 0
            for layer in bucket.layers:
                n = len(comp.wire_dtypes(layer))
                part, pos = tensors[pos:pos + n], pos + n
                if layer.name in apply:   # applied to the weights after the checks
                    updates.append((layer, part, -apply[layer.name][1] / size))
                else:
                    comp.decompress_add(bufs[layer.name], part, layer, alpha=alpha)
        for name, buf in bufs.items():
            out[name] = buf if exact_scale else buf.div_(size)

    # -- buffers ----------------------------------------------------------------------------
    def _owned(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
            buf = torch.empty_like(t)
            if self.reuse_buffers:
                self._buffers[key] = buf
        return buf.copy_(t)

    def _zeroed(self, layer, device, into: dict) -> torch.Tensor:
        target = into.get(layer.name)
        if target is not None and target.device == torch.device(device):
            return target.zero_()
        buf = self._buffers.get(layer.name)
        if buf is None or buf.device != torch.device(device):
            buf = torch.empty(layer.numel, dtype=torch.float32, device=device)
            if self.reuse_buffers:
                self._buffers[layer.name] = buf
        return buf.zero_()


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
