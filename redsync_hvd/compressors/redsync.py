"""RedSync (Fang et al., JPDC 2019): select about k of the residual, quantise, allgather.

    idx  = select_topk(v, k, selection.method)       # exact | trimmed | tbs | sampled (core/selection.py)
    message.quantize == sign_mean:
        keep one sign of v[idx] (alternating per step, or the side with the larger mean: SBC's rule)
        send (idx of that sign, ONE float: their mean)
    message.quantize in (none, fp16):
        send (idx, v[idx])
    v[idx] -= what receivers will reconstruct        (the exchange: decompress_add(alpha=-1))

``selection.scope: bucket`` (the default on CUDA) selects for all layers of a bucket at once
when its last gradient arrives (``core/bucket_select.py``: histogram thresholds, one host wait
per bucket), with the same messages. ``selection.method: radix`` selects exactly k per layer of
a bucket on the device with no host wait at all, and messages of a size known in advance
(``exact_k.py``).

Indices travel as int32, or as Golomb-Rice coded gaps (``message.index_coding: golomb``, about
8-12 bits each instead of 32, for a sort and a CPU encode per layer).
"""
from __future__ import annotations

import torch

from ..core.bucket_select import select_bucket
from ..core.golomb import decode_positions, encode_positions
from ..core.selection import SelectionState, scan_request, select_topk
from .base import Compressor, Layer, Message
from .exact_k import ExactK


class RedSyncCompressor(Compressor):
    collective = "allgather"
    checks_finite = True   # select_topk raises NonFiniteError from a pass it makes anyway

    def __init__(self, config, comm=None):
        super().__init__(config, comm)
        self.selection_state: dict[str, SelectionState] = {}   # per layer: the threshold to reuse
        radix = getattr(getattr(config, "selection", None), "method", None) == "radix"   # (SBC has no selection)
        self.exact_k = ExactK(config) if radix else None

    # -- wire format ----------------------------------------------------------
    def _quantize(self, layer: Layer | None) -> str:
        """The layer's message (a ``policy.layers`` override), else the config's."""
        return (layer.quantize if layer is not None else None) or self.config.message.quantize

    def _value_dtype(self, layer: Layer | None = None):
        return {"none": torch.float32, "fp16": torch.float16, "sign_mean": torch.float32}[self._quantize(layer)]

    def wire_dtypes(self, layer: Layer) -> tuple:
        golomb = self.config.message.index_coding == "golomb"
        return ((torch.uint8, torch.int32) if golomb else (layer.index_dtype,)) + (self._value_dtype(layer),)

    def _kinds(self, layer: Layer | None = None) -> tuple:
        index = ("indices", "headers") if self.config.message.index_coding == "golomb" else ("indices",)
        return index + ("scalars" if self._quantize(layer) == "sign_mean" else "values",)

    # -- compress -------------------------------------------------------------
    def _method(self, layer: Layer) -> str:
        return layer.selection or self.config.selection.method

    def _state(self, layer: Layer) -> SelectionState:
        return self.selection_state.setdefault(layer.name, SelectionState())

    def scan_request(self, layer: Layer, step: int):
        if self.exact_k is not None:
            return None
        return scan_request(self._state(layer), layer.k, self._method(layer),
                            threshold_reuse=self.config.selection.threshold_reuse)

    def compress(self, x: torch.Tensor, layer: Layer, step: int, scan=None) -> Message:
        if self.exact_k is not None:   # a bucket of one layer
            return self.compress_bucket([x], [layer], step)[0]
        s = self.config.selection
        idx = select_topk(x, layer.k, self._method(layer), state=self._state(layer),
                          scan=scan.result if scan is not None else None, threshold_reuse=s.threshold_reuse,
                          tbs_max_probes=s.tbs_max_probes, trimmed_eps=s.trimmed_eps,
                          sample_fraction=s.sample_fraction, name=layer.name)
        selected = idx.numel()
        vals = x.index_select(0, idx)
        if self._quantize(layer) == "sign_mean":
            idx, value = self._sign_mean(idx, vals, step)
        else:
            value = vals.to(self._value_dtype(layer))
        return self._message(idx, value, layer, selected)

    def _message(self, idx: torch.Tensor, value: torch.Tensor, layer: Layer, selected: int) -> Message:
        return Message(self._encode_indices(idx, value, layer), self._kinds(layer), selected=selected, k=layer.k,
                       positions=idx)

    def selects_by_bucket(self, layers: list) -> bool:
        scope = self.config.selection.scope
        if self.exact_k is not None:
            return True
        if scope == "auto":
            # CUDA's bincount has no deterministic kernel: deterministic runs select per layer
            return (self.config.selection.method == "tbs" and all(l.device.type == "cuda" for l in layers)
                    and not any(l.selection or l.quantize for l in layers)
                    and not torch.are_deterministic_algorithms_enabled())
        return scope == "bucket"

    def keeps_low_precision(self, layers: list) -> bool:
        return self.exact_k is not None   # the compensation kernel reads fp16/bf16 itself

    def scan_request_bucket(self, layers: list, step: int):
        if self.exact_k is not None:
            return self.exact_k.request(layers, step)
        return super().scan_request_bucket(layers, step)

    def compress_bucket(self, xs: list, layers: list, step: int, scan=None) -> list:
        if self.exact_k is not None:
            return self._compress_exact_k(xs, layers, step, scan)
        if not self.selects_by_bucket(layers):
            return super().compress_bucket(xs, layers, step, scan)
        sign_mean = self.config.message.quantize == "sign_mean"
        got = select_bucket(xs, [l.k for l in layers], sign=self._sign(step) if sign_mean else None, mean=sign_mean)
        messages = []
        for layer, idx, value, selected, bad in zip(layers, got.indices, got.values, got.selected, got.nonfinite):
            msg = self._message(idx, value if sign_mean else value.to(self._value_dtype()), layer, selected)
            msg.nonfinite = bad   # sent empty; every rank fails the step in finish()
            messages.append(msg)
        return messages

    def _compress_exact_k(self, xs: list, layers: list, step: int, scan) -> list:
        """One selection for the bucket; each layer's message is its slice of the bucket's wire
        tensors (``Message.bucket``, what the transport sends) and its device non-finite flag."""
        wire, bad = self.exact_k.select(xs, layers, step, scan)
        return [Message(part, self._kinds(layer), selected=layer.k, k=layer.k, positions=part[0], nonfinite=bad[i],
                        bucket=wire)
                for i, (layer, part) in enumerate(zip(layers, self.exact_k.split(layers, wire)))]

    # -- the bucket's wire: flat with radix, else layer by layer (Compressor's defaults) ----------
    def bucket_tensors(self, layers, messages: list) -> list:
        return messages[0].bucket if self.exact_k is not None else super().bucket_tensors(layers, messages)

    def bucket_dtypes(self, layers) -> list:
        return self.exact_k.dtypes() if self.exact_k is not None else super().bucket_dtypes(layers)

    def fixed_bucket_counts(self, layers):
        return self.exact_k.counts(layers) if self.exact_k is not None else None

    def split_bucket(self, layers, tensors: list) -> list:
        if self.exact_k is not None:
            return self.exact_k.split(layers, tensors)
        return super().split_bucket(layers, tensors)

    def decodes_flat(self, layers) -> bool:
        return self.exact_k is not None

    def decompress_bucket(self, out: dict, per_rank: list, layers, alpha: float = 1.0, *, flat=None,
                          zero=None) -> None:
        if self.exact_k is not None and flat is not None and len(out) == len(layers):
            self.exact_k.decode(flat, per_rank, layers, alpha, zero)
        else:
            super().decompress_bucket(out, per_rank, layers, alpha, flat=flat, zero=zero)

    def _sign(self, step: int) -> str:
        if self.config.message.sign_rule == "alternate":
            return "pos" if step % 2 == 0 else "neg"
        return "larger"

    def _sign_mean(self, idx: torch.Tensor, vals: torch.Tensor, step: int):
        pos = vals > 0
        if self._sign(step) == "pos":
            keep = pos
        elif self._sign(step) == "neg":
            keep = vals < 0
        else:  # larger: the side whose mean magnitude is larger (SBC)
            n_pos, n_neg = int(pos.sum()), int((vals < 0).sum())
            mu_pos = vals[pos].sum() / max(n_pos, 1)
            mu_neg = -vals[vals < 0].sum() / max(n_neg, 1)
            keep = pos if bool(mu_pos >= mu_neg) else vals < 0
        idx, kept = idx[keep], vals[keep]
        mean = kept.mean().reshape(1) if kept.numel() else torch.zeros(1, device=vals.device)
        return idx, mean.float()

    def _encode_indices(self, idx: torch.Tensor, value: torch.Tensor, layer: Layer) -> list:
        if self.config.message.index_coding != "golomb":
            return [idx.to(layer.index_dtype), value]
        order = torch.argsort(idx)
        idx = idx[order]
        if value.numel() > 1:
            value = value[order]
        payload, b = encode_positions(idx.cpu(), layer.numel)
        meta = torch.tensor([idx.numel(), b], dtype=torch.int32)
        return [payload.to(idx.device), meta.to(idx.device), value]

    # -- decompress -----------------------------------------------------------
    def indices(self, tensors: list, layer: Layer) -> torch.Tensor:
        if self.config.message.index_coding != "golomb":
            return tensors[0].to(torch.int64)
        count, b = (int(v) for v in tensors[1].tolist())
        return decode_positions(tensors[0].cpu(), count, b).to(tensors[0].device)

    def decompress_add(self, out, tensors, layer, alpha=1.0, ctx=None):
        idx = self.indices(tensors, layer).to(out.device)
        if not idx.numel():
            return
        value = tensors[-1].to(device=out.device, dtype=out.dtype)
        if self._quantize(layer) == "sign_mean":
            value = value.expand(idx.numel())
        out.index_add_(0, idx, value, alpha=alpha)

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"selection": {n: s.state_dict() for n, s in self.selection_state.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.selection_state = {}
        for name, s in state.get("selection", {}).items():
            self.selection_state[name] = SelectionState()
            self.selection_state[name].load_state_dict(s)
