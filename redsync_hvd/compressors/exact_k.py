"""RedSync with ``selection.method: radix``: exactly k per layer of a bucket, chosen on the device.

The bucket is the unit, kept as one flat buffer (``compresses_flat``: the exchange builds a
``BucketPlan`` for it, exchange/plan.py), and each of the exchange's four steps is one call
over it (``core/radix_select.py``; Triton kernels on CUDA, the same steps in torch ops
elsewhere):

    1. compensate  memory: x = r + g (DGC: velocity too) + histogram 1   rs.compensate
    2. compress    here:   exactly k positions per layer, values or means  rs.select(hist=...,
                           and x -= what receivers decode, velocity masked   update=True)
    3. update      memory: nothing left (done in 2's write)
    4. send        transport: [positions (K,), values (K,) | means (L,)], sizes known in advance
       decode      transport: every rank's message in rank order          rs.decode_add

Nothing is read back to the host, and the message of a bucket has the same size on every
rank and step (K = sum of the layers' k), so the transport needs no header allgather.
With ``message.quantize: sign_mean`` each layer sends exactly k elements of the kept sign
(alternating, or SBC's larger side) and their signed mean magnitude; with ``none``/``fp16``
the k largest |x| and their values. A layer's part of the message is the codec's message
(codec.py), so one layer decodes as RedSync's does.
"""
from __future__ import annotations

import torch

from ..core import radix_select as rs
from ..core.passes import Compensated
from ..core.segments import VECTOR, Segments
from .base import Compressor, FlatMessage, Layer, Message
from .codec import MessageCodec

MAX_LAYOUTS = 16   # layouts (k per layer) kept with their device tables and workspaces


class ExactKCompressor(Compressor):
    collective = "allgather"
    checks_finite = True   # the selection flags NaN/Inf on the device

    def __init__(self, config, comm=None):
        super().__init__(config, comm)
        self.codec = MessageCodec(config.message.quantize, "raw", config.message.sign_rule)
        self.backend = config.selection.radix_backend
        self._segments: dict = {}

    def wire_dtypes(self, layer: Layer) -> tuple:
        return (torch.int32, self.codec.value_dtype)

    # -- the bucket's layout and its four steps ------------------------------------------------
    def compresses_flat(self, layers: list) -> bool:
        return True

    def selects_by_bucket(self, layers: list) -> bool:
        return True

    def keeps_low_precision(self, layers: list) -> bool:
        return True   # the compensation kernel reads fp16/bf16 itself

    def segments(self, layers, align: int = VECTOR) -> Segments:
        """The bucket's layout at this step's k (cached: k changes only with the density policy), each
        layer starting at a multiple of 16 elements so the kernels load 128 bits at a time."""
        key = (align,) + tuple((l.name, l.numel, l.k) for l in layers)
        seg = self._segments.get(key)
        if seg is None:
            seg = self._segments[key] = Segments([l.numel for l in layers], [l.k for l in layers], align=align)
            if len(self._segments) > MAX_LAYOUTS:   # a budget policy picks new k's every few steps
                self._segments.pop(next(iter(self._segments)))
        return seg

    def first_pass_flat(self, seg: Segments, step: int) -> rs.BucketRequest:
        return rs.BucketRequest(seg, self.codec.sign(step), self.backend)

    def compress_flat(self, c, seg: Segments, step: int, update: bool = True) -> FlatMessage:
        """One ``rs.select`` over the flat x (``core.passes.Compensated``): exactly k per layer, and with
        ``update`` x -= what receivers decode and the velocity zeroed there, in the same write."""
        residual = update and c.first is not None   # NoMemory hands the gradient itself
        sel = rs.select(seg, c.x, sign=self.codec.sign(step), mean=self.codec.mean, hist=c.first,
                        index_dtype=torch.int32, value_dtype=self.codec.value_dtype, update=residual,
                        velocity=c.velocity if residual else None, backend=self.backend)
        return FlatMessage([sel.positions, sel.means if self.codec.mean else sel.values], sel.nonfinite,
                           updated=residual)

    # -- one layer alone (a bucket of one) ---------------------------------------------------
    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        seg = self.segments([layer], align=1)   # x is the layer alone: no padding
        msg = self.compress_flat(Compensated(x.float()), seg, step, update=False)
        return Message(msg.tensors, self.codec.kinds, selected=layer.k, k=layer.k, positions=msg.tensors[0],
                       nonfinite=msg.nonfinite[0])

    def decompress_add(self, out, tensors, layer, alpha=1.0, ctx=None):
        self.codec.decode_add(out, tensors, layer, alpha)

    # -- the bucket's wire -----------------------------------------------------------------------
    def bucket_tensors(self, layers, messages: list) -> list:
        """Layer by layer (a bucket compressed per layer: its layers' momenta differ) into the flat
        bucket's format: [positions (K,), values (K,) or means (L,)]."""
        return [torch.cat([m.tensors[i] for m in messages]) for i in (0, 1)]

    def bucket_dtypes(self, layers) -> list:
        return [torch.int32, self.codec.value_dtype]

    def fixed_bucket_counts(self, layers):
        seg = self.segments(layers)
        return [seg.k_total, len(seg) if self.codec.mean else seg.k_total]

    def split_bucket(self, layers, tensors: list) -> list:
        """[positions, values or means] of a bucket -> each layer's [positions, values or (mean,)]."""
        k = self.segments(layers).kofs
        pos, second = tensors
        mean = self.codec.mean
        return [[pos[k[i]:k[i + 1]], second[i:i + 1] if mean else second[k[i]:k[i + 1]]]
                for i in range(len(layers))]

    def decodes_flat(self, layers) -> bool:
        return True

    def decompress_bucket(self, out, per_rank: list, layers, alpha: float = 1.0, *, flat=None,
                          zero=None) -> None:
        """flat += alpha * every rank's bucket message, in rank order, in one ``rs.decode_add``
        (``flat`` laid out by ``segments``); layer by layer into ``out`` without it."""
        if flat is None:
            return super().decompress_bucket(out, per_rank, layers, alpha, zero=zero)
        seg = self.segments(layers)
        if len(per_rank) == 1:
            pos, second = per_rank[0][0][None], per_rank[0][1][None]
        else:
            pos, second = (torch.stack([t[i] for t in per_rank]) for i in (0, 1))
        wire = {"means": second} if self.codec.mean else {"values": second}
        rs.decode_add(seg, flat, pos, alpha=alpha, zero=zero, backend=self.backend, **wire)
