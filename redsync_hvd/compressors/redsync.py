"""RedSync (digest sections 0-2): select about k of the residual, quantise, allgather.

    idx  = select_topk(v, k, selection)            # exact | trimmed | tbs | sampled
    sign_mean:  keep one sign (alternate per step, or the side with the larger mean),
                send idx of that sign + ONE float: their mean
    fp16/none:  send idx + values
    v[idx] -= what receivers will reconstruct        (done by the exchange via decompress_add)

``selection_scope: bucket`` (the default on CUDA) selects for all layers of a bucket at
once when its last gradient arrives (``core/bucket_select.py``: histogram thresholds,
one host wait per bucket), with the same messages.

Indices travel as int32, or Golomb-Rice coded gaps (``index_coding: golomb``,
about 8-12 bits each instead of 32, at the cost of a sort and a CPU encode).
"""
from __future__ import annotations

import torch

from ..core.bucket_select import select_bucket
from ..core.selection import SelectionState, scan_request, select_topk
from .base import Compressor, Layer, Message
from .topk import k_for


class RedSyncCompressor(Compressor):
    collective = "allgather"
    checks_finite = True   # select_topk raises NonFiniteError from a pass it makes anyway

    def __init__(self, config):
        super().__init__(config)
        self.selection_state: dict[str, SelectionState] = {}
        self._sent: dict[str, torch.Tensor] = {}
        self._scans: dict = {}

    # -- wire format ----------------------------------------------------------
    def _value_dtype(self):
        return {"none": torch.float32, "fp16": torch.float16, "sign_mean": torch.float32}[self.config.quantize]

    def wire_dtypes(self, layer: Layer) -> tuple:
        index = (torch.uint8, torch.int32) if self.config.index_coding == "golomb" else (layer.index_dtype,)
        return index + (self._value_dtype(),)

    def _kinds(self) -> tuple:
        index = ("indices", "headers") if self.config.index_coding == "golomb" else ("indices",)
        return index + ("scalars" if self.config.quantize == "sign_mean" else "values",)

    # -- compress -------------------------------------------------------------
    def _method(self, layer: Layer) -> str:
        return getattr(layer, "selection", None) or self.config.selection

    def scan_request(self, layer: Layer, step: int):
        state = self.selection_state.setdefault(layer.name, SelectionState())
        req = scan_request(state, k_for(layer), self._method(layer), threshold_reuse=self.config.threshold_reuse)
        self._scans[layer.name] = req
        return req

    def compress(self, x: torch.Tensor, layer: Layer, step: int) -> Message:
        c = self.config
        k = k_for(layer)
        state = self.selection_state.setdefault(layer.name, SelectionState())
        req = self._scans.pop(layer.name, None)
        idx = select_topk(x, k, self._method(layer), state=state, scan=req.result if req else None,
                          threshold_reuse=c.threshold_reuse, tbs_max_probes=c.tbs_max_probes,
                          trimmed_eps=c.trimmed_eps, sample_fraction=c.sample_fraction, name=layer.name)
        selected = idx.numel()
        vals = x.index_select(0, idx)
        if c.quantize == "sign_mean":
            idx, value = self._sign_mean(idx, vals, step)
        else:
            value = vals.to(self._value_dtype())
        self._sent[layer.name] = idx   # for momentum masking, without decoding our own message
        return Message(self._encode_indices(idx, value, layer), self._kinds(), selected=selected, k=k)

    def selects_by_bucket(self, layers: list) -> bool:
        scope = getattr(self.config, "selection_scope", "layer")   # subclasses (SBC) select per layer
        if scope == "auto":
            # CUDA's bincount has no deterministic kernel: deterministic runs select per layer
            return (self.config.selection == "tbs" and all(l.device.type == "cuda" for l in layers)
                    and not any(getattr(l, "selection", None) for l in layers)
                    and not torch.are_deterministic_algorithms_enabled())
        return scope == "bucket"

    def compress_bucket(self, xs: list, layers: list, step: int) -> tuple[list, list]:
        c = self.config
        sign_mean = c.quantize == "sign_mean"
        sign = None
        if sign_mean:
            sign = ("pos" if step % 2 == 0 else "neg") if c.sign_rule == "alternate" else "larger"
        ks = [k_for(l) for l in layers]
        got = select_bucket(xs, ks, sign=sign, mean=sign_mean)
        messages = []
        for layer, k, idx, value, selected in zip(layers, ks, got.indices, got.values, got.selected):
            if not sign_mean:
                value = value.to(self._value_dtype())
            self._sent[layer.name] = idx
            messages.append(Message(self._encode_indices(idx, value, layer), self._kinds(), selected=selected, k=k))
        return messages, [l.name for l, bad in zip(layers, got.nonfinite) if bad]

    def _sign_mean(self, idx: torch.Tensor, vals: torch.Tensor, step: int):
        pos = vals > 0
        if self.config.sign_rule == "alternate":
            keep = pos if step % 2 == 0 else vals < 0
        else:  # larger: the side whose mean magnitude is larger (SBC)
            n_pos, n_neg = int(pos.sum()), int((vals < 0).sum())
            mu_pos = vals[pos].sum() / max(n_pos, 1)
            mu_neg = -vals[vals < 0].sum() / max(n_neg, 1)
            keep = pos if bool(mu_pos >= mu_neg) else vals < 0
        idx, kept = idx[keep], vals[keep]
        mean = kept.mean().reshape(1) if kept.numel() else torch.zeros(1, device=vals.device)
        return idx, mean.float()

    def _encode_indices(self, idx: torch.Tensor, value: torch.Tensor, layer: Layer) -> list:
        if self.config.index_coding != "golomb":
            return [idx.to(layer.index_dtype), value]
        from ..core.golomb import encode_positions
        order = torch.argsort(idx)
        idx = idx[order]
        if value.numel() > 1:
            value = value[order]
        payload, b = encode_positions(idx.cpu(), layer.numel)
        meta = torch.tensor([idx.numel(), b], dtype=torch.int32)
        return [payload.to(idx.device), meta.to(idx.device), value]

    # -- decompress -----------------------------------------------------------
    def indices(self, tensors: list, layer: Layer) -> torch.Tensor:
        if self.config.index_coding != "golomb":
            return tensors[0].to(torch.int64)
        from ..core.golomb import decode_positions
        count, b = (int(v) for v in tensors[1].tolist())
        return decode_positions(tensors[0].cpu(), count, b).to(tensors[0].device)

    def decompress_add(self, out, tensors, layer, alpha=1.0):
        idx = self.indices(tensors, layer).to(out.device)
        if not idx.numel():
            return
        value = tensors[-1].to(device=out.device, dtype=out.dtype)
        if self.config.quantize == "sign_mean":
            value = value.expand(idx.numel())
        out.index_add_(0, idx, value, alpha=alpha)

    def sent_indices(self, message: Message, layer: Layer) -> torch.Tensor:
        return self._sent.pop(layer.name)

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"selection": {n: s.state_dict() for n, s in self.selection_state.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.selection_state = {}
        for name, s in state.get("selection", {}).items():
            self.selection_state[name] = SelectionState()
            self.selection_state[name].load_state_dict(s)
