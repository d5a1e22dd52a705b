"""The compressor contract, GRACE-style, framework-neutral (torch tensors only).

A compressor turns one layer's flat fp32 tensor into a :class:`Message`: the tensors that go on
the wire, and what was sent (``positions``) and what a decoder needs that did not travel
(``ctx``). ``decompress_add`` adds a message back into a dense buffer. The same
``decompress_add`` with ``alpha=-1`` removes the sent part from the residual, so what leaves
the residual is by construction exactly what the receivers reconstruct.

``collective`` says how messages meet:
  * ``allreduce`` - every rank's message has the same shape and meaning and is averaged
    (dense, fp16, random-k with shared positions, IWP values, PowerSGD factors);
  * ``allgather`` - messages differ per rank (own indices, own counts); every rank receives
    all of them and sums the decoded contributions.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from ..core.layout import k_of


@dataclass
class Layer:
    """A parameter as the exchange sees it. The policy decides ``compressed``, ``base_density`` and
    ``selection`` once at start and ``density`` every step."""
    name: str
    shape: tuple
    numel: int
    index: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    density: float = 1.0
    compressed: bool = True
    param: Optional[torch.Tensor] = None   # the parameter itself, for methods that weigh by |w| (IWP)
    base_density: float = 1.0              # density after warm-up
    selection: Optional[str] = None        # a per-layer selection override (policy.layers)
    quantize: Optional[str] = None         # a per-layer message.quantize override (policy.layers, RedSync)

    @property
    def k(self) -> int:
        """Elements a sparse method sends this step: ceil(density * numel)."""
        return k_of(self.numel, self.density)

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
    positions: Optional[torch.Tensor] = None   # int64 positions this rank sent (momentum masking)
    ctx: Any = None                  # what decoding needs that did not travel (shared positions, P)
    extra_bytes: dict = field(default_factory=dict)  # bytes sent by collectives run inside compress
    nonfinite: Any = None            # True, or a device flag: the input held NaN/Inf (nothing was selected)

    def nbytes(self) -> dict:
        out: dict = dict(self.extra_bytes)
        for t, kind in zip(self.tensors, self.kinds):
            out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
        return out


@dataclass
class FlatMessage:
    """What one rank sends for a whole bucket compressed flat (``Compressor.compresses_flat``):
    the bucket's wire tensors (sizes known before the step: ``fixed_bucket_counts``), a device
    flag per layer that its input held NaN/Inf, and whether the compressor already subtracted
    what it sent from x while it wrote the message (then the memory update has nothing left)."""
    tensors: list
    nonfinite: torch.Tensor
    updated: bool = False


class Compressor(ABC):
    collective: ClassVar[str] = "allgather"
    # True when compress() raises core.selection.NonFiniteError for NaN/Inf input: the
    # exchange then skips its own finite-check pass over compressed layers
    checks_finite: ClassVar[bool] = False
    # True when compress() waits on a collective of its own (IWP's broadcast, PowerSGD's P round):
    # the exchange then compresses such layers in one fixed order in finish(), never in a hook,
    # where ranks whose backward passes produce gradients in different orders could deadlock
    blocking: ClassVar[bool] = False
    # "own": the residual keeps x - decode(own message), before anything is sent (error feedback);
    # "aggregate": x - decode(average of all messages), after the collective (PowerSGD)
    error_feedback: ClassVar[str] = "own"

    def __init__(self, config: Any = None, comm: Any = None):
        self.config = config
        self.comm = comm   # for compressors that run collectives of their own (blocking)

    def wire_dtypes(self, layer: Layer) -> tuple:
        """dtypes of the tensors ``compress`` returns for this layer (fixed per layer)."""
        raise NotImplementedError

    def first_pass(self, layer: Layer, step: int):
        """What this layer's selection reads first (a ``core.passes.ScanRequest``), for the memory
        to make in the pass that computes x, or None. The exchange hands what the memory made
        (``Compensated.first``) to ``compress``."""
        return None

    @abstractmethod
    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        """x: flat fp32 tensor (gradient plus residual); ``first``: the pass ``first_pass`` asked
        for, made over x, or None. Must neither modify x nor return a view of it (the memory
        update overwrites x before the message is sent); only dense pass-through compressors
        without a memory may return x itself."""

    @abstractmethod
    def decompress_add(self, out: torch.Tensor, tensors: list, layer: Layer, alpha: float = 1.0,
                       ctx: Any = None) -> None:
        """out += alpha * decode(tensors); out is flat fp32 of layer.numel elements."""

    # -- a bucket at once: the exchange's unit and the transport's packing, per layer by default ----
    def selects_by_bucket(self, layers: list) -> bool:
        """True when ``compress_bucket`` should compress these layers (one bucket) together, once
        the last of them is in."""
        return False

    def keeps_low_precision(self, layers: list) -> bool:
        """True when this unit's fp16/bf16 gradients may reach the memory as they are (its
        compensation reads them and computes in fp32); else the exchange makes them fp32 first."""
        return False

    def compress_bucket(self, xs: list, layers: list, step: int, firsts: list | None = None) -> list:
        """Messages for several layers at once (``selects_by_bucket``); per layer by default."""
        firsts = firsts or [None] * len(layers)
        return [self.compress(x, layer, step, f) for x, layer, f in zip(xs, layers, firsts)]

    # -- a bucket as one flat buffer (exactly k per layer on the device: exchange/plan.py) -----
    def compresses_flat(self, layers: list) -> bool:
        """True when this bucket is compressed as one flat buffer (``compress_flat``), with message
        sizes known before the step: the exchange then builds a ``BucketPlan`` for it."""
        return False

    def segments(self, layers: list):
        """The bucket's layout at this step's k (``core.segments.Segments``), for ``compress_flat``."""
        raise NotImplementedError

    def first_pass_flat(self, seg, step: int):
        """What the flat selection reads first (``core.radix_select.BucketRequest``)."""
        raise NotImplementedError

    def compress_flat(self, c, seg, step: int) -> FlatMessage:
        """One rank's message for a bucket from its ``core.passes.Compensated`` flat x."""
        raise NotImplementedError

    def bucket_tensors(self, layers, messages: list) -> list:
        """What a bucket of these messages sends: every message's tensors, layer by layer."""
        return [t for m in messages for t in m.tensors]

    def bucket_dtypes(self, layers) -> list:
        """The dtypes of ``bucket_tensors``, known before the step."""
        return [d for layer in layers for d in self.wire_dtypes(layer)]

    def fixed_bucket_counts(self, layers):
        """The element count of every tensor of ``bucket_tensors`` when it is known before the
        step and the same on every rank (it may depend on the step's k), else None. Known counts
        let the transport skip the header allgather: one collective fewer per bucket."""
        return None

    def bucket_capacity(self, layers):
        """The most elements each tensor of ``bucket_tensors`` holds this step, the same on every
        rank (it may depend on the step's k), where the compressor bounds them, else None. A
        transport that must know every rank's size before an allgather (torch.distributed) then
        sends one row of that capacity with the sizes inside, instead of a header round first."""
        return None

    def split_bucket(self, layers, tensors: list) -> list:
        """One rank's ``bucket_tensors`` cut back into each layer's wire tensors."""
        parts, at = [], 0
        for layer in layers:
            n = len(self.wire_dtypes(layer))
            parts.append(tensors[at:at + n])
            at += n
        return parts

    def decodes_flat(self, layers) -> bool:
        """True when ``decompress_bucket`` decodes a bucket in one pass over one flat buffer."""
        return False

    def decompress_bucket(self, out: dict | None, per_rank: list, layers, alpha: float = 1.0, *, flat=None,
                          zero=None) -> None:
        """out[name] += alpha * decode(that layer's part of every rank's bucket message), ranks in
        order, for every layer named in ``out`` (fp32 buffers). ``flat``: with ``decodes_flat``, one
        buffer laid out by the bucket's ``segments`` (``out`` is then None); ``zero``: a buffer of
        that layout set to 0 at every decoded position (DGC's momentum masking), only where the
        bucket is decoded flat. Per layer by default."""
        if zero is not None:
            raise ValueError(f"{type(self).__name__} decodes layer by layer: it cannot mask a flat buffer")
        for tensors in per_rank:
            for layer, part in zip(layers, self.split_bucket(layers, tensors)):
                if layer.name in out:
                    self.decompress_add(out[layer.name], part, layer, alpha=alpha)

    def commit(self) -> None:  # noqa: B027 (stateless compressors keep nothing)
        """Every rank finished the step: keep the state it changed (PowerSGD's warm Q)."""

    def rollback(self) -> None:  # noqa: B027 (stateless compressors keep nothing)
        """The step failed or a GradScaler skips it: forget the state it changed, as the memory does."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 (stateless compressors keep nothing)
        pass
