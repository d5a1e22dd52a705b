"""Sparse Binary Compression's message (Sattler et al., 2019), on a model delta A = R + (W_local - W):

    P = topk(A, k); Q = topk(-A, k); mu+ = mean(A[P]); mu- = mean(-A[Q])
    S = mu+ at P  if mu+ >= mu-  else  -mu- at Q       (one sign, one value)
    send (Golomb-coded positions of S, mu)             R = A - S (via decompress_add)

The wire format (and its decoder) is the RedSync codec's (codec.py) sign_mean/none message
with Golomb-coded indices; only the choice of positions differs. Communication delay (``local_steps``) lives
in the optimizer, which feeds model deltas instead of gradients.
"""
from __future__ import annotations

import torch

from ..core.select import Contract, select, single
from .base import Layer, Message
from .redsync import RedSyncCompressor

# the exact top-k as torch.topk ranks it, NaN without a word: the exchange takes each layer's
# finite evidence instead, so a NaN delta fails the step or is passed on
TOPK = Contract("exact", finite=False)


class SBCCompressor(RedSyncCompressor):
    checks_finite = False

    def first_pass(self, layer: Layer, step: int):
        return None   # torch.topk on both signs below: nothing to fuse

    def selects_by_bucket(self, layers: list) -> bool:
        return False

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        """The k largest of the side with the larger mean, and that mean (``binarize``), or the k
        largest |A| and their values: the exact strategy's sign rule (``core/select/``)."""
        binarize = self.config.message.binarize
        sel = select(single(layer.numel, layer.k), x, TOPK, sign="larger" if binarize else None, mean=binarize)
        idx = sel.positions
        value = [sel.means.float()] if binarize else self.codec_of(layer).to_wire(x.index_select(0, idx))
        return self._message(idx, value, layer, idx.numel())
