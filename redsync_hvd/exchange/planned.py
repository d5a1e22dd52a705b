"""A bucket kept flat: exactly k per layer on the device, laid out once, run or replayed every step.

RedSync with ``selection.method: radix`` (``compressors/exact_k.py``) sends exactly k elements per
layer, so every shape of a bucket's step is known once each layer's k is: offsets, message sizes,
kernel grids. Such a bucket owns its gradient buffer (each layer's gradient is a view of it; the
Horovod adapter makes these views the parameters' ``.grad``, so backward writes them in place),
its residuals and DGC velocities (a flat block of the memory's state, ``memory/state.py``: the
layers' views of one double-buffered tensor per kind), and runs its step as device work only,
with no host read and no per-layer call:

    0. gradients   into ``self.grad``, copied only where they did not land there
    1. compensate  x = r + g (DGC: u = m u + g, x = r + u) and the first histogram   compensate
    2. compress    exactly k per layer: positions, values or one mean per layer;     select
                   x -= what receivers decode and u zeroed there, in the same write (3. update)
    4. send        [positions | values or means | count of non-finite layers]: one allgather,
                   whose size every rank knows (no header)
    finish         every rank's message decoded, in rank order, into ``self.grad``  decode_add

On CUDA, steps 1-4 of a layout that has run eagerly twice are captured into a CUDA graph and
replayed with one launch (``graph.py``). A change of any layer's k (the density warm-up's stages,
a budget's choice: ``LayerPolicy.layout_key``) is a new layout, built once.
"""
from __future__ import annotations

import time

import torch

from ..comm.packing import pack, unpack_fixed
from ..compressors.base import Message
from ..core.segments import VECTOR, Segments
from ..core.select import HistogramRequest, compensate, decode_add, select
from ..core.stats import CommStats
from .buckets import Bucket, account
from .graph import CapturedSteps
from .step import Arrived, StepState

MAX_LAYOUTS = 16   # layouts (k per layer) kept with their device tables and workspaces


def flat_frame(layers: tuple) -> Segments:
    """A planned bucket's frame: its layers back to back, each aligned to the kernels' vector."""
    return Segments([l.numel for l in layers], [0] * len(layers), align=VECTOR)


class PlannedBucket(Bucket):
    """One flat bucket of exactly-k layers; see the module docstring.

    compressor: its ``flat`` (``FlatCodec``) gives the message codec (sign rule, sign_mean or
        values, the values' wire dtype) and the radix contract, whose backend runs the kernels;
    memory: the exchange's memory, whose state keeps this bucket's block (laid out by
        ``flat_frame(layers)``), or None without error feedback (x is the gradient itself);
    terms: DGC's (``momentum``, ``nesterov``, ``masking``), or {} (``memory.flat_terms``);
    graphs: "auto" | "on" | "off" (``compression.cuda_graph``)."""
    kind = "planned"

    def __init__(self, index: int, layers: tuple, compressor, memory, comm, stats, policy, buffers, *,
                 terms: dict | None = None, clip: float | None, graphs: str = "auto"):
        self.codec, self.contract = compressor.flat.codec, compressor.flat.contract
        self.frame = flat_frame(tuple(layers))
        self.terms = dict(terms or {})
        self.kinds = ("residual",) + (("velocity",) if self.terms.get("momentum") is not None else ())
        self.key, self.block = ("planned", index), None   # the block of the memory's state: the first step takes it
        self.hints: dict = {}   # the selection's last k-th keys, where its backend starts from them (native)
        super().__init__(index, layers, compressor, memory, comm, stats, policy, buffers, evidence=False,
                         clip=clip, together=True)
        self.signs = (self.codec.sign(0), self.codec.sign(1))   # the kept sign alternates with the parity, or not
        self.dtypes = [torch.int32, self.codec.value_dtype, torch.int32]
        cuda = self.layers[0].device.type == "cuda"
        self.graphs = CapturedSteps(graphs) if cuda else None
        self.grad: torch.Tensor | None = None
        self.views: dict = {}
        self._layouts: dict = {}       # layout key -> (Segments, its stats, its per-layer stats)

    @property
    def path(self) -> str:
        """Which path runs the step, for the logs: eager, or replayed from a CUDA graph."""
        return "eager" if self.graphs is None else self.graphs.describe()

    def clear(self) -> None:
        self._grads, self._moves, self._dtypes = [], [], set()
        self._handle = self._flags = self._seg = None
        self._step_figures, self._seconds = None, 0.0

    def gradient_views(self, dtype: torch.dtype, device) -> dict:
        """{name: the layer's view of the flat gradient buffer} (made on first use, or for another
        dtype or device): where gradients should land."""
        if self.grad is None or self.grad.dtype != dtype or self.grad.device != torch.device(device):
            self.grad = torch.zeros(self.frame.n, dtype=dtype, device=device)
            self.views = dict(zip(self.names, self.frame.views(self.grad)))
        return self.views

    # -- the step ----------------------------------------------------------------------------
    def add(self, layer, grad: torch.Tensor, st: StepState) -> None:
        """A layer's gradient: noted only where it did not land in ``self.grad`` (step 0 copies it)."""
        view = self.views.get(layer.name)
        if view is None or grad.data_ptr() != view.data_ptr() or grad.dtype != view.dtype:
            self._moves.append((layer.name, grad))
        self._dtypes.add(grad.dtype)
        self._grads.append((layer.name, grad))
        if len(self._grads) == len(self.layers):
            t0 = time.perf_counter()
            payload = self._run(st)
            self._seconds = time.perf_counter() - t0   # its figures go to the stats in finish()
            self._handle = self.comm.allgather_async(payload, name=self.name,
                                                     sizes=[payload.numel()] * self.comm.size)        # 4.

    def _run(self, st: StepState) -> torch.Tensor:
        grad = self._load(st.grad_scale)                                                              # 0.
        seg, figures, layer_figures = self._layout(st.layout)
        if self.memory is not None:   # its block of the memory's state, looked up: a step calls nothing there
            state, blk = self.memory.state, self.memory.state.blocks.get(self.key)
            if blk is None or blk.device != grad.device:   # the first step, after a load, on another device
                blk = state.block(self.key, dict.fromkeys(self.kinds, self.frame.n),
                                  dict.fromkeys(self.kinds, torch.float32), grad.device, self.names, self.frame)
            self.block, blk.written = blk, True   # it writes the spare halves: the memory's commit swaps them
        args = (seg, grad, st.step)
        if st.observe:   # the budget's statistics: an eager step that shows x
            payload, flags = self._device_step(*args, observe=True)
        else:
            payload, flags = self._replayed(args, seg, st.step)
        self._seg, self._flags, self._step_figures = seg, flags, (figures, layer_figures)
        return payload

    def _load(self, scale) -> torch.Tensor:
        """Step 0: the gradients in ``self.grad``; those that landed there are not copied, the others
        (``add`` noted them) in one ``torch._foreach_copy_``. With a GradScaler's scale or local
        clipping the buffer is fp32 and both apply here."""
        dtype = next(iter(self._dtypes)) if len(self._dtypes) == 1 and scale is None and self.clip is None \
            else torch.float32
        device = self._moves[0][1].device if self._moves else self.grad.device
        if self.grad is None or self.grad.dtype != dtype or self.grad.device != torch.device(device):
            self.gradient_views(dtype, device)
            self._moves = self._grads   # a new buffer: every gradient is copied in
        views = self.views
        if self._moves:
            torch._foreach_copy_([views[n] for n, _ in self._moves], [g.detach().reshape(-1) for _, g in self._moves])
        if scale is not None:   # residuals and the wire keep unscaled values
            self.grad.div_(scale)
        if self.clip is not None:    # a factor of 1.0 leaves the values bit for bit
            for v in views.values():
                v.mul_((self.clip / v.norm().clamp(min=1e-30)).clamp(max=1.0))
        return self.grad

    def _replayed(self, args: tuple, seg: Segments, step: int) -> tuple:
        """Steps 1-4 replayed from this layout's CUDA graph, captured now if it is due, or eagerly."""
        if self.graphs is None:
            return self._device_step(*args)
        key = self._key(seg, step)
        out = self.graphs.replay(key)
        if out is None and self.graphs.due(key):
            out = self.graphs.capture(self._device_step, args, key)
        return out if out is not None else self._device_step(*args)

    def _device_step(self, seg: Segments, grad: torch.Tensor, step: int, observe: bool = False) -> tuple:
        """Steps 1-4 as device work only (what a CUDA graph captures): (payload, per-layer flags)."""
        sign, m, t = self.signs[step % 2], self.memory, self.terms
        if m is None:   # no error feedback: x is the gradient itself, and nothing is updated
            x, hist, velocity = grad.float(), None, None
        else:                                                                                         # 1.
            r, u = self.block.pairs["residual"], self.block.pairs.get("velocity")
            extra = {} if u is None else {"velocity": u.cur, "velocity_out": u.spare, "momentum": t["momentum"],
                                          "nesterov": t["nesterov"]}
            hist = compensate(r.cur, grad, r.spare, first=HistogramRequest(seg, sign, self.contract), **extra)
            x, velocity = r.spare, (u.spare if u is not None and t["masking"] else None)
        if observe:
            self.policy.observe(list(self.layers), seg.views(x), step, [self.views[n] for n in self.names])
        sel = select(seg, x, self.contract, sign=sign, mean=self.codec.mean, first=hist,                     # 2.-3.
                     index_dtype=torch.int32, value_dtype=self.codec.value_dtype, update=m is not None,
                     velocity=velocity, state=self.hints)
        flag = sel.nonfinite.sum(dtype=torch.int32).reshape(1)
        return pack([sel.positions, sel.means if self.codec.mean else sel.values, flag], grad.device)[1], \
            sel.nonfinite

    def _key(self, seg: Segments, step: int) -> tuple:
        """What a captured step depends on besides its inputs' values: the layout, the kept sign and
        which buffers are current (they swap at every commit)."""
        pairs = () if self.memory is None else tuple(p.cur.data_ptr() for p in self.block.pairs.values())
        return seg.serial, self.signs[step % 2], pairs, self.grad.data_ptr()

    def _layout(self, key: tuple) -> tuple:
        """This step's layout and its per-step figures, built once per layout (``policy.layout_key``,
        taken with the step's first gradient, changes whenever some layer's k may have)."""
        got = self._layouts.get(key)
        if got is None:
            seg = Segments([l.numel for l in self.layers], [l.k for l in self.layers], align=VECTOR)
            got = self._layouts[key] = (seg, *self._figures(seg))
            if len(self._layouts) > MAX_LAYOUTS:   # a budget policy picks new k's every few steps
                self._layouts.pop(next(iter(self._layouts)))
        return got

    def _figures(self, seg: Segments) -> tuple:
        """One step's bytes by kind and its per-layer figures at this layout (the same every step)."""
        scratch = CommStats()
        kinds = self.codec.kinds
        for layer, k in zip(self.layers, seg.ks):
            second = torch.empty(1 if self.codec.mean else k, dtype=self.codec.value_dtype, device="meta")
            account(scratch, layer, Message([torch.empty(k, dtype=torch.int32, device="meta"), second], kinds,
                                            selected=k, k=k))
        scratch.add_bytes({"scalars": 4})   # the bucket's count of non-finite layers
        return dict(scratch.step), scratch.layers

    def _counts(self, seg: Segments) -> list:
        return [seg.k_total, len(seg) if self.codec.mean else seg.k_total, 1]

    # -- finish ----------------------------------------------------------------------------------
    def finish(self, into: dict, apply: dict) -> Arrived:
        """1. every rank's message, cut by the sizes known in advance; 2. layers to apply to the
        weights become updates; 3. the rest decoded in rank order into ``self.grad`` (fp32), whose
        views are the averages (the Horovod adapter's ``.grad``: nothing is copied)."""
        seg, size = self._seg, self.comm.size
        self.stats.add_time("select", "sparse", self._seconds)
        self.stats.add_many(self._step_figures[0])
        self.stats.layers.update(self._step_figures[1])
        with self.stats.timer("communicate", "allgather"):
            payload = self.comm.wait(self._handle)
        with self.stats.timer("decompress", "allgather"):
            per_rank = unpack_fixed(payload, self._counts(seg), self.dtypes, size)                   # 1.
            got = Arrived(flags=torch.cat([p[-1] for p in per_rank]))
            exact = size & (size - 1) == 0
            alpha = 1.0 / size if exact else 1.0
            if any(n in apply for n in self.names):                                                  # 2.
                self._updates(seg, per_rank, into, apply, exact, got)
            else:                                                                                    # 3.
                flat = self.grad if self.grad.dtype == torch.float32 else \
                    self.buffers.get(("planned", self.index), self.frame.n, torch.float32, self.grad.device)
                pos = per_rank[0][0][None] if size == 1 else torch.stack([p[0] for p in per_rank])
                second = per_rank[0][1][None] if size == 1 else torch.stack([p[1] for p in per_rank])
                wire = {"means": second} if self.codec.mean else {"values": second}
                decode_add(seg, flat.zero_(), pos, alpha=alpha, contract=self.contract, **wire)
                if not exact:
                    flat.div_(size)
                got.averages.update(self.views if flat is self.grad else zip(self.names, self.frame.views(flat)))
        return got

    def _updates(self, seg: Segments, per_rank: list, into: dict, apply: dict, exact: bool, got: Arrived) -> None:
        """Layer by layer: updates for the applied layers, decodes into zeroed buffers for the rest."""
        k, alpha = seg.kofs, 1.0 / self.comm.size if exact else 1.0
        out = {l.name: self.buffers.zeroed(l, into) for l in self.layers if l.name not in apply}
        for pos, second, _ in per_rank:
            for i, layer in enumerate(self.layers):
                part = [pos[k[i]:k[i + 1]], second[i:i + 1] if self.codec.mean else second[k[i]:k[i + 1]]]
                if layer.name in apply:
                    got.updates.append((layer, part, -apply[layer.name][1] / self.comm.size))
                else:
                    self.codec.decode_add(out[layer.name], part, layer, alpha)
        if not exact:
            for t in out.values():
                t.div_(self.comm.size)
        got.averages.update(out)

    def flagged(self) -> list:
        if self._flags is None:
            return []
        return [n for n, bad in zip(self.names, self._flags.tolist()) if bad]
