"""Importance-weighted pruning on allreduce (IWP; Cheng & Xu, 2019).

    leader = draw(seed, step)  in [0, N)           same on every rank, no communication
    leader: idx = top-k of |r| / (|w| + eps)
    idx = broadcast(idx, root=leader)              k int32 indices, once
    v = r[idx]; r[idx] = 0                         (via decompress_add(alpha=-1))
    G[idx] = allreduce_average(v)

Because every rank sends values at the same positions, the message is reduced
by a plain (ring) allreduce whose cost does not grow with N, unlike allgather.
The price: one broadcast per layer before the allreduce can start, and only the
leader's view of importance decides what everyone sends.
"""
from __future__ import annotations

import random

import torch

from ..core.select import Contract, NonFiniteError, select, single
from .base import Compressor, Layer, Message, Wire


class IWPCompressor(Compressor):
    collective = "allreduce"
    blocking = True   # waits on the leader's broadcast inside compress

    def __init__(self, config, comm=None):
        super().__init__(config, comm)
        self.leaders: list = []     # (step, leader) history of this run, for inspection and tests

    def wire(self, layer: Layer) -> Wire:
        """k fp32 values by allreduce, after the leader's broadcast of k int32 positions."""
        return Wire((torch.float32,), ("values",), (layer.k,), fixed=True, extra=(("broadcast", 4 * layer.k),))

    def leader(self, step: int) -> int:
        return random.Random(self.config.seed * 1_000_003 + step).randrange(self.comm.size)

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        k, leader = layer.k, self.leader(step)
        if not self.leaders or self.leaders[-1] != (step, leader):
            self.leaders.append((step, leader))
        leads = self.comm.is_root(leader)
        if leads:
            weight = layer.param.detach().reshape(-1).abs().to(x) if layer.param is not None else 0.0
            importance = x.abs() / (weight + self.config.eps)
            contract, seg = Contract(layer.selection or self.config.selection), single(layer.numel, k)
            try:
                idx = select(seg, importance, contract, name=layer.name).positions
            except NonFiniteError:
                # the others wait on this broadcast: rank NaN/Inf first and send; the exchange's own
                # finite check (every rank's evidence) then fails the step or passes the NaN on
                most = torch.finfo(importance.dtype).max
                ranked = torch.nan_to_num(importance, nan=most, posinf=most)
                idx = select(seg, ranked, contract, name=layer.name).positions
            idx = idx.to(torch.int32)
        else:
            idx = torch.empty(k, dtype=torch.int32, device=x.device)
        idx = self.comm.wait(self.comm.broadcast_async(idx, root=leader, name=f"rsync.iwp.{layer.name}"))
        idx = idx.to(torch.int64)
        return Message([x.index_select(0, idx)], ("values",), selected=k, k=k, positions=idx, ctx=idx,
                       extra_bytes={"indices": 4 * k} if leads else {})

    def decompress_add(self, out, tensors, layer, alpha=1.0, ctx=None):
        out.index_add_(0, ctx, tensors[0].to(out), alpha=alpha)

    def state_dict(self) -> dict:
        return {"leaders": list(self.leaders[-1000:])}
