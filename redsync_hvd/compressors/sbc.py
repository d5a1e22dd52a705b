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

from ..core.wire import wide_mean
from .base import Layer, Message
from .redsync import RedSyncCompressor


class SBCCompressor(RedSyncCompressor):
    # torch.topk ranks NaN without a word (RedSync's select_topk refuses it): the exchange takes
    # each layer's finite evidence instead, so a NaN delta fails the step or is passed on
    checks_finite = False

    def first_pass(self, layer: Layer, step: int):
        return None   # torch.topk on both signs below: nothing to fuse

    def selects_by_bucket(self, layers: list) -> bool:
        return False

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        k = layer.k
        if self.config.message.binarize:
            pos_vals, pos_idx = torch.topk(x, k, sorted=False)
            neg_vals, neg_idx = torch.topk(-x, k, sorted=False)
            mu_pos, mu_neg = wide_mean(pos_vals), wide_mean(neg_vals)
            if bool(mu_pos >= mu_neg):
                idx, value = pos_idx, mu_pos.reshape(1)
            else:
                idx, value = neg_idx, -mu_neg.reshape(1)
        else:
            idx = torch.topk(x.abs(), k, sorted=False).indices
            value = x.index_select(0, idx)
        return self._message(idx, value.float(), layer, idx.numel())
