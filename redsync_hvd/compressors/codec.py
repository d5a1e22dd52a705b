"""One message format for RedSync (Fang et al., 2019), its exact-k variant and SBC (Sattler et al., 2019).

    message.quantize none | fp16:  [positions, values]   values in the wire's dtype
    message.quantize int8:         [positions, codes, scale]   int8 codes, one float32 scale per layer:
                                                        a value is code * scale, scale = max|v| / 127
    message.quantize sign_mean:    [positions, mean]     one float32: the signed mean of the kept
                                                        sign's values (its sign rule: ``sign``)
    message.index_coding golomb:   positions as [Golomb-Rice bytes, (count, b) int32] (core/golomb.py)
                           raw:    positions as int32 (int64 past 2**31 elements)

A receiver adds ``values`` (or the mean at every position) into its buffer (``decode_add``);
the sender runs the same code with alpha = -1 on its residual, so what leaves the residual is
exactly what the receivers reconstruct, rounding included. That is why int8 needs no
stochastic rounding (QSGD's): what a code rounds off waits in the residual for a later message.
"""
from __future__ import annotations

import torch

from ..core.golomb import decode_positions, encode_positions
from ..core.select.reference import keep_side, kept_mean
from ..core.wire import to_wire

VALUE_DTYPES = {"none": torch.float32, "fp16": torch.float16, "int8": torch.int8, "sign_mean": torch.float32}
INT8_LEVELS = 127   # codes in [-127, 127]: symmetric, so a value and its negation round alike


class Encoded(list):
    """An encoded message's wire tensors as its sender holds them, with the int64 positions they
    encode (in the payload's order) beside them: the sender's own decode (the memory's update, x -=
    what receivers decode) reads them instead of decoding its Golomb payload again. What a receiver
    cuts out of the gathered payload is a plain list, decoded."""

    def __init__(self, tensors: list, positions: torch.Tensor):
        super().__init__(tensors)
        self.positions = positions.to(torch.int64)


class MessageCodec:
    """Encode and decode one layer's (positions, values) message; see the module docstring."""

    def __init__(self, quantize: str, index_coding: str = "raw", sign_rule: str = "alternate"):
        if quantize not in VALUE_DTYPES:
            raise ValueError(f"message.quantize={quantize!r} is not one of {sorted(VALUE_DTYPES)}")
        self.quantize, self.golomb, self.sign_rule = quantize, index_coding == "golomb", sign_rule
        self.mean = quantize == "sign_mean"
        self.scaled = quantize == "int8"   # the values travel as codes, with one scale after them
        self.value_dtype = VALUE_DTYPES[quantize]

    def sign(self, step: int) -> str | None:
        """The sign a sign_mean message keeps at ``step``: alternating ("pos" on even steps), or
        "larger" (SBC's rule: the side whose mean magnitude is larger); None without sign_mean."""
        if not self.mean:
            return None
        if self.sign_rule == "alternate":
            return "pos" if step % 2 == 0 else "neg"
        return "larger"

    def wire_dtypes(self, layer) -> tuple:
        return ((torch.uint8, torch.int32) if self.golomb else (layer.index_dtype,)) + (self.value_dtype,) \
            + ((torch.float32,) if self.scaled else ())

    @property
    def kinds(self) -> tuple:
        """What each wire tensor is, for byte accounting."""
        index = ("indices", "headers") if self.golomb else ("indices",)
        return index + ("scalars" if self.mean else "values",) + (("scales",) if self.scaled else ())

    @property
    def index_parts(self) -> int:
        """How many wire tensors carry the positions (the values follow them)."""
        return 2 if self.golomb else 1

    def to_wire(self, values: torch.Tensor) -> list:
        """Values as they travel: [values in the wire's float type, clamped to its finite range
        (``core/wire.py``)], or with int8 [codes, scale]. The residual keeps what this rounding and
        clamping lose."""
        if not self.scaled:
            return [to_wire(values, self.value_dtype)]
        scale = (values.abs().amax() if values.numel() else values.new_zeros(())) / INT8_LEVELS
        codes = torch.round(values / torch.clamp(scale, min=torch.finfo(torch.float32).tiny))
        return [codes.clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8), scale.reshape(1).float()]

    def values(self, tensors: list) -> torch.Tensor:
        """The float32 values an encoded message carries: the values, or code * scale, or the mean."""
        return self.decoded(tensors[self.index_parts:])

    def decoded(self, value: list) -> torch.Tensor:
        """The float32 values that :meth:`to_wire`'s list (or sign_mean's [mean]) stands for."""
        if self.scaled:
            return value[0].float() * value[1].float()
        return value[0] if value[0].dtype == torch.float32 else value[0].float()

    def in_order(self, positions: torch.Tensor, value: list) -> tuple:
        """(positions, value) as :meth:`encode` sends them: Golomb-coded positions go ascending, their
        values with them (a threshold select's are ascending already); raw ones as selected."""
        if not self.golomb or positions.numel() < 2 or bool((positions[1:] > positions[:-1]).all()):
            return positions, value
        order = torch.argsort(positions)
        return positions[order], value if self.mean else [value[0][order], *value[1:]]

    def encode(self, positions: torch.Tensor, value: list, layer) -> list:
        """[positions (int32 or Golomb-coded), *value]; ``value``: :meth:`to_wire`'s list, or
        [the one mean (1,)] with sign_mean; both as :meth:`in_order` gives them."""
        if not self.golomb:
            return Encoded([positions.to(layer.index_dtype), *value], positions)
        payload, b = encode_positions(positions.cpu(), layer.numel)
        meta = torch.tensor([positions.numel(), b], dtype=torch.int32)
        return Encoded([payload.to(positions.device), meta.to(positions.device), *value], positions)

    def positions(self, tensors: list, layer) -> torch.Tensor:
        """The int64 positions of an encoded message (its sender's :class:`Encoded` knows them)."""
        known = getattr(tensors, "positions", None)
        if known is not None:
            return known
        if not self.golomb:
            return tensors[0].to(torch.int64)
        count, b = (int(v) for v in tensors[1].tolist())
        return decode_positions(tensors[0].cpu(), count, b).to(tensors[0].device)

    def decode_add(self, out: torch.Tensor, tensors: list, layer, alpha: float = 1.0) -> None:
        """out += alpha * the message, out flat float32 of the layer's size. Raw positions index as
        they arrived: ``index_add_`` takes int32 as it takes int64, with the same sums."""
        idx = getattr(tensors, "positions", None)   # the sender's own, known
        if idx is None:
            idx = self.positions(tensors, layer) if self.golomb else tensors[0]
        if not idx.numel():
            return
        value = self.values(tensors)
        if idx.device != out.device or value.device != out.device or value.dtype != out.dtype:
            idx, value = idx.to(out.device), value.to(device=out.device, dtype=out.dtype)
        if self.mean:
            value = value.expand(idx.numel())
        out.index_add_(0, idx, value, alpha=alpha)

    def sign_mean(self, positions: torch.Tensor, values: torch.Tensor, step: int):
        """(positions kept, their mean as (1,) float32) of one sign, by ``sign(step)``: the sign
        rule applied to a selection (``core/select/reference.py:keep_side``)."""
        host = values.device.type == "cpu"   # a layer at a time on the CPU: reads cost nothing, small ops do
        kept = keep_side(values, self.sign(step), host=host).nonzero().reshape(-1)   # one nonzero for both
        return positions.index_select(0, kept), kept_mean(values.index_select(0, kept), host=host)
