"""The ``triton`` backend of the radix select (``radix.py``): compensate + select + update in five
launches per bucket.

The steps and their results match the torch reference in ``radix_ref.py`` (the tests
compare them bit for bit under ``TRITON_INTERPRET=1``); the kernels are in
``triton_kernels.py``. Per bucket, whatever its number of layers:

    _pass1    x = r + g (DGC momentum too), histogram 1 (the exponent)     reads r, g (u); writes x (u')
    _filter   digit 1's bin per row; the tile's candidates, in position     reads x; writes a few % of x
              order, into a static buffer; histogram 2; last program of
              a layer: digit 2's bin, the non-finite flag
    _refine   histogram 3 and the keys above digit 2's bin, over the        reads the candidates
              candidates; last program: T (exact), the means, SBC's side
    _count    keys above / equal to T per tile; last program: the scan     reads the candidates
    _write    positions, values, and x -= what was sent, u = 0 there        reads the candidates

Histograms are per layer and sign row; digit 1's has 256 bins (512 with the sign split) and
is summed per program (``tl.histogram``), digits 2 and 3 count only the candidates in the
chosen bin, with global atomics. A tile whose candidates do not fit its buffer (a quarter of
its elements) is read again by the stages after the filter (``spill``), so every input gives
the same result; only the time changes. The histograms and arrival counters live in a workspace per
layout, sign rows and device, zero between calls: each is zeroed by the program that reads
it last, so no step launches a fill. Nothing is read back to the host; every output size
comes from ``Segments``.

Kernels that do arithmetic the reference also does are compiled with
``enable_fp_fusion=False``: an FMA would round differently from the separate multiply and add.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..segments import BINS, NONFINITE_BIN, VECTOR, Segments, to_device
from ..wire import wire_limit
from .triton_kernels import _count, _filter, _pass1, _refine, _write

_WARPS = 8
_SMALL = 1024           # block of the decode's and the candidate stages' loops
CANDIDATE_SHARE = 4     # a tile's candidate buffer holds a quarter of its elements
PASS1_BLOCK = 4096      # elements per step of the histogram pass (tl.histogram's cost is per call)


def _block(seg: Segments, most: int, x: torch.Tensor) -> int:
    """Elements per loop step: ``most`` on a GPU; the whole tile in the interpreter, which
    pays per step for every nested call (the same code, wider)."""
    return min(seg.tile, most) if x.is_cuda else seg.tile


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Workspace:
    """A layout's buffers for one sign-row count R on one device, reused by every call.

    Zero between calls (the last reader zeroes each): hist1 (L*R, 256), hist2 (L*R, 4096),
    hist3 (L*R, 2048), arrivals (L,). Written before read in every call: prefix, need, zeros
    (L*R,); per tile: cand_n, sums (float64, R each), cnt and base (2 each); the candidates
    (bits and offset in the tile) in one 16-aligned region per tile, a quarter of its size.
    ``pending``: histogram 1 was filled by ``pass1`` and no ``select`` has consumed it yet.
    """

    def __init__(self, seg: Segments, R: int, device: torch.device):
        L, LR = len(seg), len(seg) * R
        _, lo, hi, _ = seg.tile_bounds()
        T = len(lo)
        rest = torch.zeros(LR * (BINS[0] + BINS[1] + BINS[2]) + L, dtype=torch.int32, device=device)
        sizes = [LR * BINS[0], LR * BINS[1], LR * BINS[2], L]
        hist1, hist2, hist3, self.arrivals = rest.split(sizes)
        self.hist1, self.hist2, self.hist3 = hist1.view(LR, BINS[0]), hist2, hist3
        self.prefix, self.need, self.zeros = torch.empty(3 * LR, dtype=torch.int32, device=device).split(LR)
        caps = [_round_up(_round_up(h - l, CANDIDATE_SHARE) // CANDIDATE_SHARE, VECTOR) for l, h in zip(lo, hi)]
        starts = [0]
        for c in caps:
            starts.append(starts[-1] + c)
        self.cand_lo = to_device(torch.tensor(starts, dtype=torch.int64), device)
        self.cand_bits = torch.empty(max(starts[-1], 1), dtype=torch.int32, device=device)
        self.cand_pos = torch.empty_like(self.cand_bits)
        self.cand_n = torch.empty(T, dtype=torch.int32, device=device)
        self.sums = torch.empty(T * R, dtype=torch.float64, device=device)
        self.cnt, self.base = torch.empty(2 * 2 * T, dtype=torch.int32, device=device).split(2 * T)
        self.tiles, self.pending = T, False


def workspace(seg: Segments, R: int, device) -> Workspace:
    """The layout's workspace for R sign rows on this device (built on first use, then cached)."""
    return seg.derived(f"triton-workspace:{R}", device, lambda: Workspace(seg, R, torch.device(device)))


def pass1(seg: Segments, x: torch.Tensor, R: int, *, residual=None, grad=None, velocity=None,
          velocity_out=None, momentum: float = 0.0, nesterov: bool = False) -> torch.Tensor:
    """Histogram 1 of x ((L*R, 256) int32), computing x = compensated residual first when
    ``residual`` is given. It is the workspace's: ``select`` consumes it and leaves it zeroed."""
    ws, tab = workspace(seg, R, x.device), seg.tables(x.device)
    if ws.pending:      # filled before and never consumed: start from zeros
        ws.hist1.zero_()
    comp, mom = residual is not None, velocity is not None
    _pass1[(ws.tiles,)](x, residual if comp else x, grad if comp else x, velocity if mom else x,
                        velocity_out if mom else x, ws.hist1, tab.tile_seg, tab.tile_lo, tab.tile_hi,
                        float(momentum), COMPENSATE=comp, MOMENTUM=mom, NESTEROV=bool(nesterov), R=R,
                        ALIGNED=seg.align % VECTOR == 0, BLOCK=_block(seg, PASS1_BLOCK, x), num_warps=_WARPS,
                        enable_fp_fusion=False)
    ws.pending = True
    return ws.hist1


def compensate(seg: Segments, out: torch.Tensor, R: int, residual, grad, velocity=None, velocity_out=None,
               momentum: float = 0.0, nesterov: bool = False) -> torch.Tensor:
    """The radix backend's first step (``radix.py:compensate``): ``pass1`` computing out."""
    return pass1(seg, out, R, residual=residual, grad=grad, velocity=velocity, velocity_out=velocity_out,
                 momentum=momentum, nesterov=nesterov)


def select(seg: Segments, x: torch.Tensor, R: int, active, k_row: torch.Tensor, hist: torch.Tensor | None,
           index_dtype: torch.dtype, value_dtype: torch.dtype, mean: bool, update: bool,
           velocity: torch.Tensor | None):
    """The launches of one bucket's selection; returns what ``radix.py:select`` unpacks.
    1. histogram 1: the given one, or ``pass1``; 2. the outputs; 3. filter, refine, count, write."""
    K, dev = seg.k_total, x.device
    ws = workspace(seg, R, dev)
    own = hist is None or hist.data_ptr() == ws.hist1.data_ptr()
    if hist is None:                                                                   # 1.
        hist = pass1(seg, x, R)
    elif not own and ws.pending:
        ws.hist1.zero_()
    ws.pending = False
    s0, s1 = active[0], active[-1]
    out = outputs(seg, dev, index_dtype, value_dtype)                                  # 2.
    _launch(seg, ws, x, hist, k_row, out, own=own, s0=s0, s1=s1, mean=mean, update=update, velocity=velocity) # 3.
    mags = mean or s1 != s0
    return out["pos"][:K], out["vals"][:K], out["means"] if mags else None, out["bad"], out["kth"], out["side"]


def outputs(seg: Segments, dev, index_dtype: torch.dtype, value_dtype: torch.dtype) -> dict:
    """A selection's output tensors, new each call (the caller keeps them while the next step runs)."""
    L, K = len(seg), max(seg.k_total, 1)

    def new(n, dtype):
        return torch.empty(n, dtype=dtype, device=dev)
    return dict(pos=new(K, index_dtype), vals=new(K, value_dtype), means=new(L, torch.float32),
                side=new(L, torch.int8), kth=new(L, torch.int32), bad=new(L, torch.bool))


def _launch(seg, ws, x, hist, k_row, out, **kw) -> None:
    """The four launches after histogram 1 (the stages in the module docstring)."""
    for _, launch in stages(seg, ws, x, hist, k_row, out, **kw):
        launch()


def stages(seg, ws, x, hist, k_row, out, *, own, s0, s1, mean, update, velocity) -> list:
    """(name, launch) of the four stages after histogram 1, in order (``scripts/bench_passes.py``
    times them one by one)."""
    tab, R = seg.tables(x.device), hist.shape[0] // len(seg)
    grid, aligned, block = (ws.tiles,), seg.align % VECTOR == 0, _block(seg, _SMALL, x)
    tiles = (tab.tile_seg, tab.tile_lo, tab.tile_hi)
    cands = (ws.cand_bits, ws.cand_pos, ws.cand_lo, ws.cand_n)
    u = velocity if velocity is not None else x
    return [
        ("_filter", lambda: _filter[grid](
            x, hist, ws.hist2, k_row, ws.prefix, ws.need, ws.zeros, ws.arrivals, out["bad"], *cands, *tiles,
            tab.seg_tile, NONFINITE=NONFINITE_BIN, CLEAR1=own, S0=s0, S1=s1, R=R, ALIGNED=aligned,
            BLOCK=_block(seg, 2048, x), num_warps=_WARPS)),
        ("_refine", lambda: _refine[grid](
            x, ws.hist3, k_row, ws.prefix, ws.need, ws.zeros, ws.arrivals, ws.sums, out["means"], out["side"],
            out["kth"], *cands, *tiles, tab.seg_tile, S0=s0, S1=s1, R=R, MAGS=mean or s1 != s0, ALIGNED=aligned,
            BLOCK=block, num_warps=_WARPS)),
        ("_count", lambda: _count[grid](
            x, ws.prefix, ws.need, out["side"], ws.arrivals, ws.cnt, ws.base, *cands, *tiles, tab.seg_tile, R=R,
            ALIGNED=aligned, BLOCK=block, num_warps=_WARPS)),
        ("_write", lambda: _write[grid](
            x, u, ws.prefix, ws.need, ws.base, out["side"], out["means"], tab.offsets, tab.kofs, out["pos"],
            out["vals"], *cands, *tiles, wire_limit(out["vals"].dtype), R=R, MEAN=mean, UPDATE=update,
            VELOCITY=velocity is not None, BF16=out["vals"].dtype == torch.bfloat16,
            CLAMP=out["vals"].dtype != torch.float32, ALIGNED=aligned, BLOCK=block, num_warps=_WARPS,
            enable_fp_fusion=False)),
    ]


# ---- the decode --------------------------------------------------------------------------

@triton.jit
def _decode(out_ptr, zero_ptr, pos_ptr, val_ptr, mean_ptr, offsets, kofs, tile_seg, tile_lo, tile_hi,
            K, N, L, alpha, HAS_VALUES: tl.constexpr, HAS_ZERO: tl.constexpr, LOG: tl.constexpr,
            BLOCK: tl.constexpr):
    """A program owns one tile of ``out``, so no two programs touch an element and no atomics
    are needed. For each rank in order: 1. binary-search its (ascending) positions of the
    tile's layer for the tile's range, both ends at once; 2. out[p] += alpha * value (or the
    layer's mean); 3. zero[p] = 0; 4. a barrier, so that the next rank adds to this rank's
    sums: the same order, and so the same result, on every rank."""
    t = tl.program_id(0)
    seg, lo, hi = tl.load(tile_seg + t), tl.load(tile_lo + t), tl.load(tile_hi + t)
    base, a, b = tl.load(offsets + seg), tl.load(kofs + seg), tl.load(kofs + seg + 1)
    ends = tl.arange(0, 2)
    target = tl.where(ends == 0, lo, hi) - base      # first position >= lo, first >= hi
    for r in range(N):
        row = pos_ptr + r * K
        left = tl.zeros([2], tl.int64) + a
        right = tl.zeros([2], tl.int64) + b
        for _ in range(LOG):
            live = left < right
            mid = (left + right) // 2
            go = live & (tl.load(row + mid, mask=live, other=0).to(tl.int64) < target)
            right = tl.where(live & (go == 0), mid, right)
            left = tl.where(go, mid + 1, left)
        first, last = tl.sum(tl.where(ends == 0, left, 0), 0), tl.sum(tl.where(ends == 1, left, 0), 0)
        mean = tl.load(mean_ptr + r * L + seg) if not HAS_VALUES else 0.0
        for start in range(first, last, BLOCK):
            j = start + tl.arange(0, BLOCK)
            m = j < last
            p = base + tl.load(row + j, mask=m, other=0).to(tl.int64)
            v = tl.load(val_ptr + r * K + j, mask=m, other=0.0).to(tl.float32) if HAS_VALUES else mean
            o = tl.load(out_ptr + p, mask=m, other=0.0)
            tl.store(out_ptr + p, o + alpha * v, mask=m)
            if HAS_ZERO:
                tl.store(zero_ptr + p, tl.zeros_like(o), mask=m)
        tl.debug_barrier()


def decode_add(seg: Segments, out: torch.Tensor, positions: torch.Tensor, values: torch.Tensor | None,
               means: torch.Tensor | None, alpha: float, zero: torch.Tensor | None) -> None:
    """out += alpha * decode(messages), rank by rank; ``zero`` set to 0 at their positions."""
    tab = seg.tables(out.device)
    grid = (tab.tile_seg.numel(),)
    if not grid[0] or not seg.k_total:
        return
    _decode[grid](out, zero if zero is not None else out, positions, values if values is not None else out,
                  means if means is not None else out, tab.offsets, tab.kofs, tab.tile_seg, tab.tile_lo,
                  tab.tile_hi, seg.k_total, positions.shape[0], len(seg), float(alpha),
                  HAS_VALUES=values is not None, HAS_ZERO=zero is not None,
                  LOG=max(1, seg.max_k.bit_length() + 1), BLOCK=_SMALL, num_warps=4, enable_fp_fusion=False)
