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
    # a bool scalar on the layer's device, True where the input held NaN/Inf (nothing was selected);
    # None where the compressor did not look (the bucket's own evidence covers it)
    nonfinite: Optional[torch.Tensor] = None

    def nbytes(self) -> dict:
        out: dict = dict(self.extra_bytes)
        for t, kind in zip(self.tensors, self.kinds):
            out[kind] = out.get(kind, 0) + t.numel() * t.element_size()
        return out


@dataclass(frozen=True)
class Wire:
    """One layer's message as it travels, known before the step (``Compressor.wire``).

    dtypes, kinds: of each wire tensor, in order (kinds label bytes: "indices", "values", ...);
    counts: each tensor's elements at the layer's k: exact where ``fixed``, else what a step
        sends on average (what the cost model prices);
    fixed: the counts are exact and the same on every rank: a bucket of such layers needs no
        header of sizes;
    capacity: the most elements each tensor holds, where the compressor bounds them (a transport
        that needs every rank's size first, torch.distributed, then sends one row of that size);
    extra: bytes per worker of collectives the compressor runs itself, by collective (IWP's index
        broadcast, PowerSGD's P allreduce)."""
    dtypes: tuple
    kinds: tuple
    counts: tuple
    fixed: bool = False
    capacity: Optional[tuple] = None
    extra: tuple = ()

    def nbytes(self, workers: int = 1) -> float:
        """Bytes per worker per step: the message, plus its header of counts where not fixed, plus
        the compressor's own collectives (a broadcast's bytes are sent by its root: 1/workers each
        on average)."""
        header = 0 if self.fixed else 4 * len(self.dtypes)
        own = sum(b / workers if kind == "broadcast" else b for kind, b in self.extra)
        return sum(n * d.itemsize for n, d in zip(self.counts, self.dtypes)) + header + own


class Compressor(ABC):
    """GRACE's compressor: ``compress`` a layer's x into a :class:`Message`, ``decompress_add`` one
    back, its ``collective``, its ``wire`` cost, its state (``commit`` / ``rollback`` follow the
    memory's transaction, ``state_dict`` the checkpoint). Capabilities are class variables, read
    once when the exchange is built."""
    collective: ClassVar[str] = "allgather"
    # True when compress() raises core.select.NonFiniteError for NaN/Inf input: the
    # exchange then skips its own finite-check pass over compressed layers
    checks_finite: ClassVar[bool] = False
    # True when compress() waits on a collective of its own (IWP's broadcast, PowerSGD's P round):
    # the exchange then compresses such layers in one fixed order in finish(), never in a hook,
    # where ranks whose backward passes produce gradients in different orders could deadlock
    blocking: ClassVar[bool] = False
    # "own": the residual keeps x - decode(own message), before anything is sent (error feedback);
    # "aggregate": x - decode(average of all messages), after the collective (PowerSGD)
    error_feedback: ClassVar[str] = "own"
    # True when the message is x itself in fp32 (dense fp32): its average is the summed buffer / N
    passthrough: ClassVar[bool] = False
    # True when the message is every element of the layer, at most cast (dense fp32, fp16): nothing is
    # selected or encoded, so a step costs the allreduce of its bytes and no measured per-element rate
    dense_wire: ClassVar[bool] = False
    # a ``FlatCodec`` where the compressor sends exactly k per layer of a bucket kept as one flat
    # buffer on the device (compressors/exact_k.py): the exchange then plans such buckets
    flat: ClassVar[Any] = None

    def __init__(self, config: Any = None, comm: Any = None):
        self.config = config
        self.comm = comm   # for compressors that run collectives of their own (blocking)

    @abstractmethod
    def wire(self, layer: Layer) -> Wire:
        """What this layer's message looks like on the wire at its current k."""

    def first_pass(self, layer: Layer, step: int):
        """What this layer's selection reads first (a ``core.select.ScanRequest``), for the memory
        to make in the pass that computes x, or None. The exchange hands what the memory made
        (``Compensated.first``) to ``compress``."""
        return None

    @abstractmethod
    def compress(self, x: torch.Tensor, layer: Layer, step: int, first=None) -> Message:
        """x: flat fp32 tensor (gradient plus residual); ``first``: the pass ``first_pass`` asked
        for, made over x, or None. Must neither modify x nor return a view of it (the memory
        update overwrites x before the message is sent); only dense pass-through compressors
        without a memory may return x itself."""

    def selects_by_bucket(self, layers: list) -> bool:
        """True when ``compress_bucket`` should compress these layers (one bucket) together, once
        the last of them is in."""
        return False

    def compress_bucket(self, xs: list, layers: list, step: int, firsts: list | None = None) -> list:
        """Messages for several layers at once (``selects_by_bucket``, ``blocking``); per layer by default."""
        firsts = firsts or [None] * len(layers)
        return [self.compress(x, layer, step, f) for x, layer, f in zip(xs, layers, firsts)]

    @abstractmethod
    def decompress_add(self, out: torch.Tensor, tensors: list, layer: Layer, alpha: float = 1.0,
                       ctx: Any = None) -> None:
        """out += alpha * decode(tensors); out is flat fp32 of layer.numel elements."""

    def commit(self) -> None:  # noqa: B027 (stateless compressors keep nothing)
        """Every rank finished the step: keep the state it changed (PowerSGD's warm Q)."""

    def rollback(self) -> None:  # noqa: B027 (stateless compressors keep nothing)
        """The step failed or a GradScaler skips it: forget the state it changed, as the memory does."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 (stateless compressors keep nothing)
        pass
