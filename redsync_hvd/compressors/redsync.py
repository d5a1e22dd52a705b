"""RedSync (Fang et al., JPDC 2019): select about k of the residual, quantise, allgather.

    idx  = select(single(n, k), v, contract)         # exact | trimmed | tbs | sampled (core/select/)
    message.quantize == sign_mean:
        keep one sign of v[idx] (alternating per step, or the side with the larger mean: SBC's rule)
        send (idx of that sign, ONE float: their mean)
    message.quantize in (none, fp16, int8):
        send (idx, v[idx])                           (int8: codes and one scale per layer)
    v[idx] -= what receivers will reconstruct        (the exchange: decompress_add(alpha=-1))

``selection.scope: bucket`` (the default on CUDA) selects for all layers of a bucket at once
when its last gradient arrives (the selection registry's bucket backend for tbs,
``core/select/histogram.py``: histogram thresholds, one host wait per bucket), with the same
messages. ``selection.method: radix`` is its own compressor
(``exact_k.py``): exactly k per layer of a bucket on the device, with no host wait at all.

The wire format is ``codec.py``'s, shared with exact-k and SBC. Indices travel as int32, or as
Golomb-Rice coded gaps (``message.index_coding: golomb``, about 8-12 bits each instead of 32,
for a sort and a CPU encode per layer).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..core.golomb import expected_bits
from ..core.segments import Segments
from ..core.select import Contract, SelectionState, scan_request, select, single
from ..core.select.registry import backends, pick
from .base import Compressor, Layer, Message, Wire
from .codec import VALUE_DTYPES, MessageCodec
from .exact_k import ExactKCompressor

CAPACITY = 2   # a capped message's positions per layer, in units of k (``Wire.capacity``)
# what a threshold search (tbs, sampled) is expected to send with values, in units of k: it accepts
# any count in [k, 2k]. Sign-mean keeps one side of that, about k (within 5% on the digits CNN,
# tests/test_costmodel.py), so it is priced at k.
LOOSE = {"tbs": 1.5, "sampled": 1.5}


class RedSyncCompressor(Compressor):
    collective = "allgather"
    checks_finite = True   # the searches raise NonFiniteError from a pass they make anyway

    def __init__(self, config, comm=None):
        super().__init__(config, comm)
        self.selection_state: dict[str, SelectionState] = {}   # per layer: the threshold to reuse
        m = config.message
        sign_rule = getattr(m, "sign_rule", "larger")
        # one codec per message format: a policy.layers override may give a layer its own
        self.codecs = {q: MessageCodec(q, m.index_coding, sign_rule) for q in VALUE_DTYPES}
        self.codec = self.codecs[m.quantize]
        self.contracts: dict[str, Contract] = {}   # per selection method (a policy.layers override)
        self._buckets: dict = {}                    # layer names -> the bucket backend's name, or None
        self._wires: dict = {}                      # what ``wire`` answered, per layer and what it depends on

    def codec_of(self, layer: Layer | None) -> MessageCodec:
        """The layer's message format (a ``policy.layers[].quantize`` override), else the config's."""
        return self.codecs[layer.quantize] if layer is not None and layer.quantize else self.codec

    def wire(self, layer: Layer) -> Wire:
        """About k positions (int32, or Golomb-coded: their expected bytes) and their values or one
        mean; bounded at CAPACITY * k where the transport needs every rank's size first. Asked several
        times a step per layer (packing, cutting, accounting), so worked out once per layer and k."""
        key = (layer.name, layer.numel, layer.k, layer.quantize, layer.selection, getattr(self.comm, "needs_sizes", 0))
        got = self._wires.get(key)
        if got is None:
            got = self._wires[key] = self._wire(layer)
        return got

    def _wire(self, layer: Layer) -> Wire:
        codec, k = self.codec_of(layer), layer.k
        selection = getattr(self.config, "selection", None)
        if not codec.mean and selection is not None and selection.scope != "bucket":   # by bucket: about k
            k = min(layer.numel, math.ceil(LOOSE.get(self._method(layer), 1.0) * k))
        second = (1,) if codec.mean else (k, 1) if codec.scaled else (k,)
        counts = ((golomb_bytes(k, layer.numel), 2) if codec.golomb else (k,)) + second
        cap = self._capacity(layer)
        return Wire(codec.wire_dtypes(layer), codec.kinds, counts,
                    capacity=None if cap is None else (cap,) + ((1,) if codec.mean else (cap, 1) if codec.scaled
                                                                 else (cap,)))

    # -- compress -------------------------------------------------------------
    def _method(self, layer: Layer) -> str:
        return layer.selection or self.config.selection.method

    def _contract(self, layer: Layer) -> Contract:
        method = self._method(layer)
        got = self.contracts.get(method)
        if got is None:
            s = self.config.selection
            got = self.contracts[method] = Contract(method, threshold_reuse=s.threshold_reuse,
                                                    tbs_max_probes=s.tbs_max_probes, trimmed_eps=s.trimmed_eps,
                                                    sample_fraction=s.sample_fraction)
        return got

    def _state(self, layer: Layer) -> SelectionState:
        return self.selection_state.setdefault(layer.name, SelectionState())

    def first_pass(self, layer: Layer, step: int):
        return scan_request(self._state(layer), layer.k, self._contract(layer), layer.numel)

    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        idx = select(single(layer.numel, layer.k), x, self._contract(layer), state=self._state(layer), first=first,
                     name=layer.name).positions
        cap = self._capacity(layer)
        if cap is not None and idx.numel() > cap:
            idx = idx[:cap]   # a capped message: what is left stays in the residual
        selected = idx.numel()
        vals = x.index_select(0, idx)
        codec = self.codec_of(layer)
        if codec.mean:
            idx, mean = codec.sign_mean(idx, vals, step)
            value = [mean]
        else:
            value = codec.to_wire(vals)
        return self._message(idx, value, layer, selected)

    def _message(self, idx: torch.Tensor, value: list, layer: Layer, selected: int) -> Message:
        codec = self.codec_of(layer)
        idx, value = codec.in_order(idx, value)
        return Message(codec.encode(idx, value, layer), codec.kinds, selected=selected, k=layer.k,
                       positions=idx)

    # -- a bounded message where the transport needs sizes first (torch.distributed) -----------
    def _capacity(self, layer: Layer) -> int | None:
        """At most CAPACITY * k positions per layer, where the communicator must know every rank's
        size before an allgather: one round instead of a header round and the data. tbs sends k to
        2k (bucket selection caps there too); threshold reuse may send more, and the rest waits in
        the residual. Golomb-coded positions have no bound in elements: None."""
        if not getattr(self.comm, "needs_sizes", False) or self.config.message.index_coding == "golomb":
            return None
        return max(CAPACITY * layer.k, 1)

    def selects_by_bucket(self, layers: list) -> bool:
        return self._bucket_backend(layers) is not None

    def _bucket_backend(self, layers: list) -> str | None:
        """The backend that selects these layers (one bucket) at once, or None: one at a time. The
        selection registry picks it (``selection.scope`` auto: where it prefers a bucket backend,
        on CUDA; bucket: one always); a layer with its own method or message goes alone."""
        key = tuple(l.name for l in layers)
        if key not in self._buckets:
            scope, method = self.config.selection.scope, self.config.selection.method
            alone = scope == "layer" or (scope == "auto" and any(l.selection or l.quantize for l in layers)) \
                or not backends(method)   # exact: torch.topk itself, a layer at a time
            unit = "bucket" if scope == "bucket" else None
            picked = [] if alone else [pick(method, l.device, torch.float32, l.numel, unit=unit)[0] for l in layers]
            first = picked[0] if picked else None
            self._buckets[key] = first.name if first is not None and all(b is first for b in picked) \
                and first.unit == "bucket" else None
        return self._buckets[key]

    def compress_bucket(self, xs: list, layers: list, step: int, firsts: list | None = None) -> list:
        backend = self._bucket_backend(layers)
        if backend is None:
            return super().compress_bucket(xs, layers, step, firsts)
        seg = Segments([l.numel for l in layers], [min(l.k, l.numel) for l in layers])
        contract = replace(self._contract(layers[0]), backend=backend)
        sel = select(seg, torch.cat(xs), contract, sign=self.codec.sign(step), mean=self.codec.mean)
        values = None if self.codec.mean else sel.parts(sel.values)
        messages = []
        for i, (layer, idx, bad) in enumerate(zip(layers, sel.parts(), sel.nonfinite.tolist())):
            value = [sel.means[i:i + 1]] if self.codec.mean else self.codec.to_wire(values[i])
            msg = self._message(idx, value, layer, sel.selected[i])
            if bad:   # sent empty; every rank fails the step in finish()
                msg.nonfinite = torch.ones((), dtype=torch.bool, device=idx.device)
            messages.append(msg)
        return messages

    # -- decompress -----------------------------------------------------------
    def decompress_add(self, out, tensors, layer, alpha=1.0, ctx=None):
        self.codec_of(layer).decode_add(out, tensors, layer, alpha)

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"selection": {n: s.state_dict() for n, s in self.selection_state.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.selection_state = {}
        for name, s in state.get("selection", {}).items():
            self.selection_state[name] = SelectionState()
            self.selection_state[name].load_state_dict(s)


def golomb_bytes(k: int, numel: int) -> int:
    """Expected bytes of k Golomb-Rice coded positions among numel (``core/golomb.py``)."""
    p = min(max(k / max(numel, 1), 1e-12), 1 - 1e-12)
    return math.ceil(k * expected_bits(p) / 8)


def build(config, comm=None) -> Compressor:
    """RedSync's compressor for ``config``: exactly k per layer of a bucket on the device
    (``selection.method: radix``, exact_k.py), else the per-layer selections here."""
    if config.selection.method == "radix":
        return ExactKCompressor(config, comm)
    return RedSyncCompressor(config, comm)
