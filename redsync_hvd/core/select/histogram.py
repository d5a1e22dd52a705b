"""tbs a bucket at a time: the ``histogram`` backend, RedSync's selection where host waits cost.

On a GPU a layer's passes cost microseconds; what costs is each host wait, and a wait
inside a gradient hook also stalls the CPU that should be queueing the rest of the
backward pass. Searching layer by layer waits two to four times per layer. Here every
decision is made on the device, layer by layer but without reading anything back, and the
host waits once per bucket, for all the layers' counts:

    bits = float32 bit patterns of |x|      # non-negative floats order like their bits
    thr  = the k-th largest |x|, rounded down to 128 ulps, from two 4096-bin histograms
           (reference.py:histogram_threshold)
    keep = bits >= thr, and the sign rule's side (reference.py:keep_side)
    -- one host wait: every layer's count --
    idx  = nonzero_static(keep, size=count)  # no wait: the size is known

A layer sends k to k + (ties within 128 ulps) elements, capped at 2k (the ``tbs``
contract). Non-finite values sit in the top bins (bits >= 0x7F800000), so the same
histogram reports them at no extra pass. The same torch ops run on the CPU, where the
tests check them; there the per-layer native passes are several times faster.
"""
from __future__ import annotations

import torch

from .contract import Selection
from .reference import NONFINITE_BIN, histogram_threshold, keep_side, kept_mean, torch_histograms


def _threshold(bits: torch.Tensor, k: int):
    """(threshold bits, non-finite flag) for one layer, both on the device."""
    first, second = torch_histograms(bits)
    h1 = first()
    return histogram_threshold(lambda: h1, second, k).to(torch.int32), h1[NONFINITE_BIN:].sum() > 0


def _positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the first ``count`` True entries, ascending; no host wait where torch has
    nonzero_static for the device."""
    try:
        return torch.nonzero_static(mask, size=count).reshape(-1)
    except (NotImplementedError, RuntimeError):
        return torch.nonzero(mask).reshape(-1)[:count]


def select(seg, x: torch.Tensor, contract, ask) -> Selection:
    """About the k largest |x| of each segment of the flat float32 ``x``, all at once (k .. 2k).

    ``ask.sign``: keep that side of each layer's selection (None: both); ``ask.mean``: each
    layer's signed mean over what it kept instead of the values. ``selected``: per layer,
    |x| >= threshold before the sign rule (capped at 2k)."""
    keeps, stats, xs = [], [], seg.views(x)
    for v, k in zip(xs, seg.ks):
        bits = v.abs().view(torch.int32)
        thr, bad = _threshold(bits, k)
        # zeros carry nothing; a layer with NaN/Inf sends nothing (the step fails on every rank)
        sel = (bits >= thr) & (bits > 0) & ~bad
        keep = sel if ask.sign is None else keep_side(v, ask.sign, among=sel)
        keeps.append(keep)
        kept = keep.count_nonzero()
        stats += [kept, sel.count_nonzero() if ask.sign is not None else kept, bad]
    # the one host wait: every layer's counts and flags in one transfer
    host = torch.stack([s.to(torch.int64) for s in stats]).tolist()
    positions, values, means, counts, selected = [], [], [], [], []
    for i, (v, k, keep) in enumerate(zip(xs, seg.ks, keeps)):
        count, n_sel, _ = host[3 * i:3 * i + 3]
        # ties within 128 ulps past 2k: the first 2k go, the rest stays in the residual
        count = min(count, 2 * k)
        idx = _positions(keep, count)
        positions.append(idx)
        values.append(v.index_select(0, idx))
        counts.append(count)
        selected.append(min(n_sel, 2 * k))
        if ask.mean:
            means.append(kept_mean(values[-1]))
    return Selection(torch.cat(positions), tuple(counts), values=None if ask.mean else torch.cat(values),
                     means=torch.cat(means) if ask.mean else None,
                     nonfinite=torch.tensor(host[2::3], dtype=torch.bool), selected=tuple(selected))
