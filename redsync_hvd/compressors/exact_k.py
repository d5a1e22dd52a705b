"""RedSync's ``selection.method: radix``: exactly k per layer of a bucket, chosen on the device.

The bucket is the unit (``Compressor.selects_by_bucket``), and each of the exchange's four
steps is one call over the bucket's flat buffer (``core/radix_select.py``; Triton kernels on
CUDA, the same steps in torch ops elsewhere):

    1. compensate  memory: x = r + g (DGC: velocity too) + histogram 1   rs.compensate
    2. compress    here:   exactly k positions per layer, values or means  rs.select(hist=...)
    3. update      memory: x -= decode(own message), velocity masked      rs.decode_add(alpha=-1)
    4. send        transport: [positions (K,), values (K,) | means (L,)], sizes known in advance
       decode      transport: every rank's message in rank order          rs.decode_add

Nothing is read back to the host, and the message of a bucket has the same size on every
rank and step (K = sum of the layers' k), so the transport needs no header allgather.
With ``message.quantize: sign_mean`` each layer sends exactly k elements of the kept sign
(alternating, or SBC's larger side) and their signed mean magnitude; with ``none``/``fp16``
the k largest |x| and their values.
"""
from __future__ import annotations

import torch

from ..core import radix_select as rs
from ..core.segments import Segments

_VALUE_DTYPES = {"none": torch.float32, "fp16": torch.float16, "sign_mean": torch.float32}


class ExactK:
    """The bucket-level parts of RedSync with ``selection.method: radix`` (a RedSyncCompressor
    delegates to it); ``layers`` are always one bucket's, in the bucket's order."""

    def __init__(self, config):
        self.mean = config.message.quantize == "sign_mean"
        self.value_dtype = _VALUE_DTYPES[config.message.quantize]
        self.sign_rule = config.message.sign_rule
        self.backend = config.selection.radix_backend
        self._segments: dict = {}

    def segments(self, layers) -> Segments:
        """The bucket's layout at this step's k (cached: k changes only with the density warm-up)."""
        key = tuple((l.name, l.numel, l.k) for l in layers)
        seg = self._segments.get(key)
        if seg is None:
            seg = self._segments[key] = Segments([l.numel for l in layers], [l.k for l in layers])
        return seg

    def sign(self, step: int):
        if not self.mean:
            return None
        return "larger" if self.sign_rule == "larger" else ("pos" if step % 2 == 0 else "neg")

    def request(self, layers, step: int) -> rs.BucketScan:
        return rs.BucketScan(self.segments(layers), self.sign(step), self.backend)

    def select(self, xs: list, layers, step: int, scan) -> tuple:
        """(wire tensors, per-layer non-finite flags) of one bucket: 1. x: the memory's flat r + g
        and its histogram, or the layers concatenated; 2. one ``rs.select``."""
        if isinstance(scan, rs.BucketScan) and scan.x is not None:
            seg, sign, x, hist = scan.seg, scan.sign, scan.x, scan.hist
        else:   # no memory (residual: false), or one that kept the layers apart
            seg, sign, hist = self.segments(layers), self.sign(step), None
            x = torch.cat([x.reshape(-1) for x in xs]).float()
        sel = rs.select(seg, x, sign=sign, mean=self.mean, hist=hist, index_dtype=torch.int32,
                        value_dtype=self.value_dtype, backend=self.backend)
        return [sel.positions, sel.means if self.mean else sel.values], sel.nonfinite

    def dtypes(self) -> list:
        return [torch.int32, torch.float32 if self.mean else self.value_dtype]

    def counts(self, layers) -> list:
        seg = self.segments(layers)
        return [seg.k_total, len(seg) if self.mean else seg.k_total]

    def split(self, layers, tensors: list) -> list:
        """[positions, values or means] of a bucket -> each layer's [positions, values or (mean,)]."""
        seg = self.segments(layers)
        pos, second = tensors
        k = seg.kofs
        return [[pos[k[i]:k[i + 1]], second[i:i + 1] if self.mean else second[k[i]:k[i + 1]]]
                for i in range(len(seg))]

    def decode(self, flat: torch.Tensor, per_rank: list, layers, alpha: float, zero) -> None:
        """flat += alpha * every rank's bucket message, in rank order, in one ``rs.decode_add``."""
        seg = self.segments(layers)
        if len(per_rank) == 1:
            pos, second = per_rank[0][0][None], per_rank[0][1][None]
        else:
            pos, second = (torch.stack([t[i] for t in per_rank]) for i in (0, 1))
        wire = {"means": second} if self.mean else {"values": second}
        rs.decode_add(seg, flat, pos, alpha=alpha, zero=zero, backend=self.backend, **wire)
