"""A compressed bucket's step, laid out once and run, or replayed, every step.

A bucket whose compressor keeps it flat (``Compressor.compresses_flat``: exactly k per layer,
RedSync's ``selection.method: radix``) knows every shape of its step once each layer's k is
known: offsets, k per layer, message sizes, kernel grids. So its plan holds the bucket's
gradient buffer (each layer's gradient is a view of it; the Horovod adapter makes these views
the parameters' ``.grad``, so backward writes them in place, as DDP's buckets do) and runs the
step as device work only, with no host read and no per-layer call:

    0. gradients   in ``plan.grad``: copied in only where they did not land there
    1. compensate  c = memory.compensate_flat(...)       x = r + g (DGC: u too) + histogram 1
    2. compress    msg = compressor.compress_flat(c)     exactly k per layer; x -= sent, u masked
    3. update      memory.update_flat(c, msg)            (nothing left where 2 did it)
    4. pack        [positions | values or means | count of non-finite layers]: the allgather's input

``run`` makes the host bookkeeping (the memory's buffers for this step: ``memory.flat_step``)
and then the device steps 1-4, eagerly or, on CUDA, replayed from a CUDA graph
(``graph.CapturedSteps``: one graph per layout, kept sign and buffer assignment; captured once
the layout has run eagerly ``warmup`` times). A change of any layer's k (the density warm-up's
stages, a budget update) is a new layout: the compressor's ``segments`` then differ and the
plan runs eagerly again until that layout is captured. Padding between layers (each layer
starts at a multiple of the layout's alignment where ``Segments`` aligns) stays zero.
"""
from __future__ import annotations

import torch

from ..comm.packing import pack
from ..compressors.base import Message
from ..core.segments import VECTOR, Segments
from ..core.stats import CommStats
from .graph import CapturedSteps


class BucketPlan:
    """The step of one bucket kept flat; see the module docstring.

    bucket: the exchange's ``Bucket``; compressor, memory: the exchange's (``NoMemory`` without
    error feedback); graphs: "auto" | "on" | "off" (``compression.cuda_graph``)."""

    def __init__(self, bucket, compressor, memory, graphs: str = "auto"):
        self.bucket, self.layers = bucket, tuple(bucket.layers)
        self.names = [l.name for l in self.layers]
        self.comp, self.memory = compressor, memory
        # the buffer layout: where each layer lives in the flat buffers, whatever its k
        self.frame = Segments([l.numel for l in self.layers], [0] * len(self.layers), align=VECTOR)
        self.grad: torch.Tensor | None = None
        self.views: dict = {}
        self.graphs = CapturedSteps(graphs)
        self.scale: torch.Tensor | None = None   # a GradScaler's scale this step (divides the gradients)
        self.clip: float | None = None           # DGC's local clipping norm
        self.accounting: dict = {}               # one step's figures for this layout (``account``)
        self.layer_stats: dict = {}
        self._accounted = None

    @property
    def path(self) -> str:
        """Which path runs this bucket's step, for the logs: eager, or replayed from a CUDA graph."""
        return self.graphs.describe(self.grad.device if self.grad is not None else self.layers[0].device)

    def gradient_buffer(self, dtype: torch.dtype, device) -> dict:
        """{name: the layer's view of the flat gradient buffer} (made on first use, or for another
        dtype or device): where gradients should land."""
        if self.grad is None or self.grad.dtype != dtype or self.grad.device != torch.device(device):
            self.grad = torch.zeros(self.frame.n, dtype=dtype, device=device)
            self.views = {n: self.grad[o:o + s] for n, o, s in zip(self.names, self.frame.offsets, self.frame.sizes)}
        return self.views

    def load(self, grads: list) -> torch.Tensor:
        """Step 0: the bucket's gradients in ``self.grad``; those that landed there (the same
        memory) are not copied, the others in one ``torch._foreach_copy_``. With a GradScaler's
        scale or local clipping the buffer is fp32 and both apply here (per layer, eagerly)."""
        same = all(g.dtype == grads[0].dtype for g in grads) and self.scale is None and self.clip is None
        views = self.gradient_buffer(grads[0].dtype if same else torch.float32, grads[0].device)
        moves = [(views[n], g) for n, g in zip(self.names, grads) if g.data_ptr() != views[n].data_ptr()]
        if moves:
            torch._foreach_copy_([v for v, _ in moves], [g.detach().reshape(-1) for _, g in moves])
        if self.scale is not None:   # residuals and the wire keep unscaled values
            self.grad.div_(self.scale)
        if self.clip is not None:    # a factor of 1.0 leaves the values bit for bit
            for v in views.values():
                v.mul_((self.clip / v.norm().clamp(min=1e-30)).clamp(max=1.0))
        return self.grad

    def run(self, grads: list, step: int, observe=None) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's payload (uint8; its size depends only on the layout) and its per-layer
        non-finite flags (device bools, for naming the layers when a step fails): steps 0-4.
        ``observe(layers, xs, step, grads)``: shown each layer's compensated x and gradient before
        compression (the budget policy's statistics, every few steps); such a step runs eagerly."""
        grad = self.load(grads)                                                              # 0.
        seg = self.comp.segments(list(self.layers))
        fs = self.memory.flat_step(self.names, seg, grad.device)
        if observe is not None:
            return self.device_step(fs, seg, grad, step, observe)
        return self.graphs.run(self.device_step, (fs, seg, grad, step), key=self._key(fs, seg, step))

    def device_step(self, fs, seg, grad: torch.Tensor, step: int, observe=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-4 as device work only (what a CUDA graph captures)."""
        c = self.memory.compensate_flat(fs, seg, grad, self.comp.first_pass_flat(seg, step))   # 1.
        if observe is not None:
            observe(list(self.layers), list(seg.views(c.x)), step, [self.views[n] for n in self.names])
        msg = self.comp.compress_flat(c, seg, step)                                            # 2.
        self.memory.update_flat(self.layers, c, msg, self.comp)                                # 3.
        flag = msg.nonfinite.sum(dtype=torch.int32).reshape(1)
        return pack(msg.tensors + [flag], grad.device)[1], msg.nonfinite                       # 4.

    def _key(self, fs, seg, step: int) -> tuple:
        """What a captured step depends on besides its inputs' values: the layout, the kept sign
        and which buffers are current (the memory swaps them at every commit)."""
        buffers = () if fs is None else tuple(p.cur.data_ptr() for p in (fs.residual, fs.velocity) if p is not None)
        return seg.serial, self.comp.first_pass_flat(seg, step).sign, buffers, self.grad.data_ptr()

    def account(self, account) -> bool:
        """This layout's per-step figures (bytes by kind, k per layer), worked out once per layout by
        the transport's ``account`` over empty (meta) tensors of the message's sizes; True when the
        layout is new."""
        seg = self.comp.segments(list(self.layers))
        if self._accounted is seg:
            return False
        layers = list(self.layers)
        wire = [torch.empty(n, dtype=d, device="meta") for n, d in zip(self.comp.fixed_bucket_counts(layers),
                                                                      self.comp.bucket_dtypes(layers))]
        scratch = CommStats()
        for layer, part in zip(layers, self.comp.split_bucket(layers, wire)):
            account(layer, Message(part, self.comp.codec.kinds, selected=layer.k, k=layer.k), scratch)
        scratch.add_bytes({"scalars": 4})   # the bucket's count of non-finite layers
        self.accounting, self.layer_stats, self._accounted = dict(scratch.step), scratch.layers, seg
        return True

    def check(self, payload: torch.Tensor) -> None:
        """A payload whose size differs from what the compressor declared (``fixed_bucket_counts``)
        would be cut wrongly by every receiver: stop, naming both (a host comparison of sizes)."""
        counts, dtypes = self.wire_counts(), self.wire_dtypes()
        _, expect = pack([torch.empty(n, dtype=d, device="meta") for n, d in zip(counts, dtypes)], "meta")
        if expect.numel() != payload.numel():
            raise RuntimeError(f"{type(self.comp).__name__} declared fixed message sizes {counts[:-1]} for bucket "
                               f"{self.bucket.index} but its payload has {payload.numel()} bytes, not "
                               f"{expect.numel()}")

    def wire_dtypes(self) -> list:
        return self.comp.bucket_dtypes(list(self.layers)) + [torch.int32]

    def wire_counts(self) -> list:
        return list(self.comp.fixed_bucket_counts(list(self.layers))) + [1]
