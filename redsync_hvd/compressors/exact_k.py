"""RedSync with ``selection.method: radix``: exactly k per layer of a bucket, chosen on the device.

The bucket is the unit, kept as one flat buffer (the compressor offers its ``FlatCodec``; the
exchange plans such a bucket, exchange/planned.py), and each of the exchange's four steps is one
call over it (``core/select/``'s radix strategy; Triton kernels on CUDA, the same steps in torch
ops elsewhere, or any radix backend registered):

    1. compensate  memory: x = r + g (DGC: velocity too) + histogram 1   compensate
    2. compress    here:   exactly k positions per layer, values or means  select(seg, x, RADIX,
                           and x -= what receivers decode, velocity masked     first=..., update=True)
    3. update      memory: nothing left (done in 2's write)
    4. send        bucket: [positions (K,), values (K,) | means (L,)], sizes known in advance
       decode      bucket: every rank's message in rank order             decode_add

Nothing is read back to the host, and the message of a bucket has the same size on every
rank and step (K = sum of the layers' k), so the bucket needs no header allgather.
With ``message.quantize: sign_mean`` each layer sends exactly k elements of the kept sign
(alternating, or SBC's larger side) and their signed mean magnitude; with ``none``/``fp16``
the k largest |x| and their values. A layer's part of the message is the codec's message
(codec.py), so one layer decodes as RedSync's does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.select import Contract, select, single
from ..core.select.registry import check
from .base import Compressor, Layer, Message, Wire
from .codec import MessageCodec


@dataclass(frozen=True)
class FlatCodec:
    """What a bucket kept flat needs to run the selection over one buffer (exchange/planned.py):
    the message codec (sign rule, values or one mean, the values' wire dtype) and the radix
    contract, whose backend ("auto": Triton on CUDA, torch ops elsewhere) runs the kernels."""
    codec: MessageCodec
    contract: Contract

    @property
    def backend(self) -> str:
        return self.contract.backend


class ExactKCompressor(Compressor):
    collective = "allgather"
    checks_finite = True   # the selection flags NaN/Inf on the device

    def __init__(self, config, comm=None):
        super().__init__(config, comm)
        self.codec = MessageCodec(config.message.quantize, "raw", config.message.sign_rule)
        self.contract = Contract("radix", backend=check("radix", config.selection.radix_backend))
        self.flat = FlatCodec(self.codec, self.contract)

    def wire(self, layer: Layer) -> Wire:
        """Exactly k int32 positions and k values or one mean: the same on every rank."""
        k = layer.k
        return Wire((torch.int32, self.codec.value_dtype), self.codec.kinds, (k, 1 if self.codec.mean else k),
                    fixed=True)

    def selects_by_bucket(self, layers: list) -> bool:
        return True

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        """One layer alone (a bucket that is not kept flat): the radix select over it."""
        sel = select(single(layer.numel, layer.k), x.float(), self.contract, sign=self.codec.sign(step),
                     mean=self.codec.mean, index_dtype=torch.int32, value_dtype=self.codec.value_dtype)
        second = sel.means if self.codec.mean else sel.values
        return Message([sel.positions, second], self.codec.kinds, selected=layer.k, k=layer.k,
                       positions=sel.positions, nonfinite=sel.nonfinite[0])

    def decompress_add(self, out, tensors, layer, alpha=1.0, ctx=None):
        self.codec.decode_add(out, tensors, layer, alpha)
