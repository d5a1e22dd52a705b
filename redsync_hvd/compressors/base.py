"""The compressor contract, GRACE-style, framework-neutral (torch tensors only).

A compressor turns one layer's flat fp32 tensor into the tensors that go on the
wire (``compress``) and adds a received message back into a dense buffer
(``decompress_add``). The same ``decompress_add`` with ``alpha=-1`` removes the
sent part from the residual, so what leaves the residual is by construction
exactly what the receivers reconstruct.

``collective`` says how messages meet:
  * ``allreduce`` - every rank's message has the same shape and meaning and is
    averaged by Horovod (dense, fp16, random-k with shared positions, IWP values);
  * ``allgather`` - messages differ per rank (own indices, own counts); every
    rank receives all of them and sums the decoded contributions.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch


@dataclass
class Layer:
    """A parameter as the exchange sees it. ``density`` is set by the policy each step."""
    name: str
    shape: tuple
    numel: int
    index: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    density: float = 1.0
    compressed: bool = True
    param: Optional[torch.Tensor] = None   # the parameter itself, for methods that weigh by |w| (IWP)

    @property
    def index_dtype(self) -> torch.dtype:
        # int32 halves index bytes; only layers past 2**31 elements need int64
        return torch.int32 if self.numel < 2**31 else torch.int64


@dataclass
class Message:
    """What one rank sends for one layer. ``kinds`` labels each tensor for byte accounting."""
    tensors: list
    kinds: tuple
    selected: Optional[int] = None   # elements selected this step (sparse methods)
    k: Optional[int] = None          # target count (sparse methods)
    extra_bytes: dict = field(default_factory=dict)  # bytes sent by collectives run inside compress

    def nbytes(self) -> dict:
        out: dict = dict(self.extra_bytes)
        for t, kind in zip(self.tensors, self.kinds):
            out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
        return out


class Compressor(ABC):
    collective: ClassVar[str] = "allgather"
    # True when compress() raises core.selection.NonFiniteError for NaN/Inf input: the
    # exchange then skips its own finite-check pass over compressed layers
    checks_finite: ClassVar[bool] = False

    def __init__(self, config: Any = None):
        self.config = config

    def wire_dtypes(self, layer: Layer) -> tuple:
        """dtypes of the tensors ``compress`` returns for this layer (fixed per layer)."""
        raise NotImplementedError

    def scan_request(self, layer: Layer, step: int):
        """A ``core.passes.ScanRequest`` for the memory to fill while it computes this layer's
        x (the first pass of the selection, fused with the compensation), or None. The next
        ``compress`` of the layer reads it back."""
        return None

    @abstractmethod
    def compress(self, x: torch.Tensor, layer: Layer, step: int) -> Message:
        """x: flat fp32 tensor (gradient plus residual). Must not modify x."""

    @abstractmethod
    def decompress_add(self, out: torch.Tensor, tensors: list, layer: Layer, alpha: float = 1.0) -> None:
        """out += alpha * decode(tensors); out is flat fp32 of layer.numel elements."""

    def selects_by_bucket(self, layers: list) -> bool:
        """True when ``compress_bucket`` should handle these layers (one bucket) together."""
        return False

    def compress_bucket(self, xs: list, layers: list, step: int) -> tuple[list, list]:
        """Messages for every layer of a bucket at once, and the names of layers whose x held
        NaN/Inf (sent empty). Only called when ``selects_by_bucket`` is True."""
        raise NotImplementedError

    def sent_indices(self, message: Message, layer: Layer):
        """Positions this rank sent (for momentum masking); None when not position-based."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
