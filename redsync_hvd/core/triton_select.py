"""Triton kernels for ``radix_select``: each stage is one launch for a whole bucket.

The steps and their order match the torch reference in ``radix_select.py`` (the tests
compare them bit for bit under ``TRITON_INTERPRET=1``). A program owns one tile (a run of
at most ``seg.tile`` elements inside one layer, ``segments.py``) and loops over it in
blocks; histograms are summed per program (``tl.histogram``) and flushed with one atomic
per non-empty bin. Launches per bucket: compensate+histogram 1; then for each of the three
digits a one-program-per-row choose kernel, with a refine pass before the last two; count,
scan and write for the compaction; a finish kernel for means and SBC's side choice. Nothing
is read back to the host; every output size comes from ``Segments``.

Kernels that do arithmetic the reference also does are compiled with
``enable_fp_fusion=False``: an FMA would round differently from the separate multiply and add.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redsync_hvd.core.segments import BINS, NONFINITE_BIN, SHIFTS, Segments
from redsync_hvd.core.wire import wire_limit

_WARPS = 8
_SMALL = 1024         # block of the per-layer scan over tiles
# rows per program of the per-row kernels (choose, scan): one on a GPU; the interpreter pays
# per program and per nested call, so it takes many rows at once (the same code, wider)
_INTERPRETER_ROWS = 16


def _block(seg: Segments) -> int:
    return min(seg.tile, 2048)


@triton.jit
def _pass1(x_ptr, r_ptr, g_ptr, u_ptr, uo_ptr, hist_ptr, tile_seg, tile_lo, tile_hi, momentum,
           COMPENSATE: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
           R: tl.constexpr, BLOCK: tl.constexpr):
    """1. x = r + g (DGC: u' = g + m*u; x = r + u', nesterov r + (g + m*u')), stored, or x
    loaded; 2. bin = the exponent of |x| (+256 for negative x when R == 2); 3. the tile's
    histogram; 4. one atomic add per non-empty bin."""
    NB: tl.constexpr = R * 256
    t = tl.program_id(0)
    seg, lo, hi = tl.load(tile_seg + t), tl.load(tile_lo + t), tl.load(tile_hi + t)
    h = tl.zeros([NB], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < hi
        if COMPENSATE:
            g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + offs, mask=m, other=0.0)
            if MOMENTUM:
                u = g + momentum * tl.load(u_ptr + offs, mask=m, other=0.0)
                tl.store(uo_ptr + offs, u, mask=m)
                if NESTEROV:
                    x = r + (g + momentum * u)
                else:
                    x = r + u
            else:
                x = r + g
            tl.store(x_ptr + offs, x, mask=m)
        else:
            x = tl.load(x_ptr + offs, mask=m, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        b = (bits & 0x7FFFFFFF) >> 23
        if R == 2:
            b += (bits < 0).to(tl.int32) * 256
        h += tl.histogram(b, NB, mask=m)
    tl.atomic_add(hist_ptr + seg * NB + tl.arange(0, NB), h, mask=h > 0)


@triton.jit
def _choose(hist_ptr, k_ptr, prefix_ptr, need_ptr, zeros_ptr, bad_ptr, LR,
            LEVEL: tl.constexpr, R: tl.constexpr, B: tl.constexpr, SHIFT: tl.constexpr,
            NONFINITE: tl.constexpr, ROWS: tl.constexpr):
    """ROWS (layer, row) pairs per program. 1. level 1: need = k, prefix = 0, the other
    side's count (sided rows rank it as key 0) and the non-finite flag from the top bins;
    else load them; 2. add the other side's zeros to bin 0 while the prefix is 0; 3. b = the
    largest bin with sum(h[b:]) >= need; 4. need -= sum(h[b+1:]), prefix |= b << SHIFT."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < LR
    bins = tl.arange(0, B)[None, :]
    h = tl.load(hist_ptr + rows[:, None] * B + bins, mask=live[:, None], other=0)
    if LEVEL == 0:
        prefix = tl.zeros([ROWS], dtype=tl.int32)
        need = tl.load(k_ptr + rows, mask=live, other=0)
        top = tl.sum(tl.where(bins >= NONFINITE, h, 0), 1)
        if R == 2:
            other = tl.load(hist_ptr + (rows ^ 1)[:, None] * B + bins, mask=live[:, None], other=0)
            zeros = tl.sum(other, 1)
            tl.store(zeros_ptr + rows, zeros, mask=live)
            top += tl.sum(tl.where(bins >= NONFINITE, other, 0), 1)
        tl.store(bad_ptr + rows // R, (top > 0).to(tl.int8), mask=live)
    else:
        prefix = tl.load(prefix_ptr + rows, mask=live, other=0)
        need = tl.load(need_ptr + rows, mask=live, other=0)
        if R == 2:
            zeros = tl.load(zeros_ptr + rows, mask=live, other=0)
    if R == 2:
        h += tl.where((bins == 0) & (prefix[:, None] == 0), zeros[:, None], 0)
    c = tl.cumsum(h, 1, reverse=True)
    b = tl.maximum(tl.sum((c >= need[:, None]).to(tl.int32), 1) - 1, 0)
    above = tl.sum(tl.where(bins > b[:, None], h, 0), 1)
    tl.store(need_ptr + rows, need - above, mask=live)
    tl.store(prefix_ptr + rows, prefix | (b << SHIFT), mask=live)


@triton.jit
def _refine(x_ptr, hist_ptr, prefix_ptr, tile_seg, tile_lo, tile_hi,
            R: tl.constexpr, B: tl.constexpr, SHIFT: tl.constexpr, PSHIFT: tl.constexpr,
            BLOCK: tl.constexpr):
    """1. the tile's rows' prefixes; 2. per element: its row (sign when R == 2) and whether
    its key's higher digits equal the prefix (few do: the chosen bin's); 3. count the next
    digit of those with global atomics: one for all of the block's smallest bin, one for its
    largest, one per element for the rest (a layer of zeros, or of a few quantised values,
    would otherwise send every element to one address)."""
    NB: tl.constexpr = R * B
    t = tl.program_id(0)
    seg, lo, hi = tl.load(tile_seg + t), tl.load(tile_lo + t), tl.load(tile_hi + t)
    p0 = tl.load(prefix_ptr + seg * R) >> PSHIFT
    p1 = tl.load(prefix_ptr + seg * R + R - 1) >> PSHIFT
    hist = hist_ptr + seg * NB
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < hi
        bits = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
        key = bits & 0x7FFFFFFF
        side = (bits < 0).to(tl.int32) if R == 2 else tl.zeros_like(bits)
        match = m & ((key >> PSHIFT) == tl.where(side == 1, p1, p0))
        b = ((key >> SHIFT) & (B - 1)) + side * B
        first = tl.min(tl.where(match, b, NB), 0)
        last = tl.max(tl.where(match, b, -1), 0)
        n_first = tl.sum((match & (b == first)).to(tl.int32), 0)
        n_last = tl.sum((match & (b == last) & (b != first)).to(tl.int32), 0)
        tl.atomic_add(hist + first, n_first, mask=n_first > 0, sem="relaxed")
        tl.atomic_add(hist + last, n_last, mask=n_last > 0, sem="relaxed")
        tl.atomic_add(hist + b, tl.full([BLOCK], 1, tl.int32), mask=match & (b != first) & (b != last), sem="relaxed")


@triton.jit
def _count(x_ptr, T_ptr, cnt_ptr, sum_ptr, tile_seg, tile_lo, tile_hi, S0: tl.constexpr,
           S1: tl.constexpr, R: tl.constexpr, MAGS: tl.constexpr, BLOCK: tl.constexpr):
    """Per tile and selected row (S0, and S1 for "larger"): 1. the row's key per element
    (sided rows: 0 on the other side); 2. how many keys are above the row's k-th key T and
    how many equal it; 3. with MAGS, the float64 sum of the keys above T (for the means)."""
    t = tl.program_id(0)
    seg, lo, hi = tl.load(tile_seg + t), tl.load(tile_lo + t), tl.load(tile_hi + t)
    t0, t1 = tl.load(T_ptr + seg * R + S0), tl.load(T_ptr + seg * R + S1)
    # per-lane tallies, reduced once per tile
    gt0, eq0 = tl.zeros([BLOCK], tl.int32), tl.zeros([BLOCK], tl.int32)
    gt1, eq1 = tl.zeros([BLOCK], tl.int32), tl.zeros([BLOCK], tl.int32)
    sum0, sum1 = tl.zeros([BLOCK], tl.float64), tl.zeros([BLOCK], tl.float64)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < hi
        bits = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
        key = bits & 0x7FFFFFFF
        side = (bits < 0).to(tl.int32)
        k0 = tl.where(side == S0, key, 0) if R == 2 else key
        above = m & (k0 > t0)
        gt0 += above.to(tl.int32)
        eq0 += (m & (k0 == t0)).to(tl.int32)
        if MAGS:
            sum0 += tl.where(above, k0.to(tl.float32, bitcast=True), 0.0).to(tl.float64)
        if S1 != S0:
            k1 = tl.where(side == S1, key, 0)
            above = m & (k1 > t1)
            gt1 += above.to(tl.int32)
            eq1 += (m & (k1 == t1)).to(tl.int32)
            sum1 += tl.where(above, k1.to(tl.float32, bitcast=True), 0.0).to(tl.float64)
    tl.store(cnt_ptr + (t * R + S0) * 2, tl.sum(gt0, 0))
    tl.store(cnt_ptr + (t * R + S0) * 2 + 1, tl.sum(eq0, 0))
    if MAGS:
        tl.store(sum_ptr + t * R + S0, tl.sum(sum0, 0))
    if S1 != S0:
        tl.store(cnt_ptr + (t * R + S1) * 2, tl.sum(gt1, 0))
        tl.store(cnt_ptr + (t * R + S1) * 2 + 1, tl.sum(eq1, 0))
        tl.store(sum_ptr + t * R + S1, tl.sum(sum1, 0))


@triton.jit
def _scan(cnt_ptr, sum_ptr, T_ptr, need_ptr, kofs, seg_tile, base_ptr, mean_ptr, side_ptr, kth_ptr, L,
          S0: tl.constexpr, S1: tl.constexpr, R: tl.constexpr, MAGS: tl.constexpr, ROWS: tl.constexpr,
          BLOCK: tl.constexpr):
    """ROWS layers per program, each over its tiles in order. 1. with MAGS: each selected
    row's mean key over its k = (sum of keys above T + need * T) / k, in float64; 2. the
    kept row: S0, or for "larger" the one with the larger mean (ties: positive); store it,
    its k-th key and its signed mean; 3. per tile, exclusive prefix sums of that row's
    above/equal counts: the tile's first output slot = keys above T before it + min(keys
    equal to T before it, need), and the keys equal to T before it."""
    segs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = segs < L
    first = tl.load(seg_tile + segs, mask=live, other=0)
    last = tl.load(seg_tile + segs + 1, mask=live, other=0)
    span = tl.max(last - first, 0)
    cols = tl.arange(0, BLOCK)[None, :]
    side = tl.zeros([ROWS], dtype=tl.int32) + S0
    if MAGS:
        k = tl.maximum(tl.load(kofs + segs + 1, mask=live, other=1) - tl.load(kofs + segs, mask=live, other=0), 1)
        s0 = tl.zeros([ROWS], dtype=tl.float64)
        s1 = tl.zeros([ROWS], dtype=tl.float64)
        for j in range(0, span, BLOCK):
            t = first[:, None] + j + cols
            m = t < last[:, None]
            s0 += tl.sum(tl.load(sum_ptr + t * R + S0, mask=m, other=0.0), 1)
            s1 += tl.sum(tl.load(sum_ptr + t * R + S1, mask=m, other=0.0), 1)
        n0 = tl.load(need_ptr + segs * R + S0, mask=live, other=0).to(tl.float64)
        n1 = tl.load(need_ptr + segs * R + S1, mask=live, other=0).to(tl.float64)
        f0 = tl.load(T_ptr + segs * R + S0, mask=live, other=0).to(tl.float32, bitcast=True).to(tl.float64)
        f1 = tl.load(T_ptr + segs * R + S1, mask=live, other=0).to(tl.float32, bitcast=True).to(tl.float64)
        mag0 = (s0 + tl.where(n0 > 0, n0 * f0, 0.0)) / k.to(tl.float64)
        mag1 = (s1 + tl.where(n1 > 0, n1 * f1, 0.0)) / k.to(tl.float64)
        if S1 != S0:
            side = (mag1 > mag0).to(tl.int32)
        mag = tl.where(side == S0, mag0, mag1)
        tl.store(mean_ptr + segs, tl.where(side == 1, -mag, mag).to(tl.float32), mask=live)
    row = segs * R + side
    tl.store(side_ptr + segs, side.to(tl.int8), mask=live)
    tl.store(kth_ptr + segs, tl.load(T_ptr + row, mask=live, other=0), mask=live)
    need = tl.load(need_ptr + row, mask=live, other=0)[:, None]
    carry_gt = tl.zeros([ROWS], dtype=tl.int32)
    carry_eq = tl.zeros([ROWS], dtype=tl.int32)
    for j in range(0, span, BLOCK):
        t = first[:, None] + j + cols
        m = t < last[:, None]
        at = (t * R + side[:, None]) * 2
        gt = tl.load(cnt_ptr + at, mask=m, other=0)
        eq = tl.load(cnt_ptr + at + 1, mask=m, other=0)
        eq_before = carry_eq[:, None] + tl.cumsum(eq, 1) - eq
        tl.store(base_ptr + t * 2, carry_gt[:, None] + tl.cumsum(gt, 1) - gt + tl.minimum(eq_before, need), mask=m)
        tl.store(base_ptr + t * 2 + 1, eq_before, mask=m)
        carry_gt += tl.sum(gt, 1)
        carry_eq += tl.sum(eq, 1)


@triton.jit
def _write(x_ptr, u_ptr, T_ptr, need_ptr, base_ptr, side_ptr, mean_ptr, offsets, kofs, pos_ptr, val_ptr,
           tile_seg, tile_lo, tile_hi, limit, R: tl.constexpr, MEAN: tl.constexpr, UPDATE: tl.constexpr,
           VELOCITY: tl.constexpr, BF16: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    """Per tile, the kept row of its layer: 1. take the keys above T and those equal to T whose
    rank among equals (position order, counted from the tile's base) is below need; 2. write
    their layer-local positions, and values in the wire's dtype (CLAMP: first clamped to
    +-limit, the wire type's finite range, as ``core/wire.py:to_wire`` does), at consecutive
    slots from the tile's first slot; 3. with UPDATE, x -= what receivers decode (the value as
    sent, or the layer's mean); with VELOCITY, u = 0 there."""
    t = tl.program_id(0)
    seg, lo, hi = tl.load(tile_seg + t), tl.load(tile_lo + t), tl.load(tile_hi + t)
    side = tl.load(side_ptr + seg).to(tl.int32)
    row = seg * R + side
    thr, need = tl.load(T_ptr + row), tl.load(need_ptr + row)
    seg_lo = tl.load(offsets + seg)
    slot = tl.load(kofs + seg) + tl.load(base_ptr + t * 2)
    eq_seen = tl.load(base_ptr + t * 2 + 1)
    mean = tl.load(mean_ptr + seg) if MEAN else 0.0
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < hi
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        key = bits & 0x7FFFFFFF
        if R == 2:
            key = tl.where((bits < 0).to(tl.int32) == side, key, 0)
        eq = (m & (key == thr)).to(tl.int32)
        take = (m & (key > thr)) | ((eq == 1) & (eq_seen + tl.cumsum(eq, 0) - eq < need))
        ti = take.to(tl.int32)
        at = slot + tl.cumsum(ti, 0) - ti
        tl.store(pos_ptr + at, (offs - seg_lo).to(pos_ptr.dtype.element_ty), mask=take)
        if MEAN:
            sent = mean
        else:
            xw = x
            if CLAMP:   # a finite value stays finite on the wire; NaN compares false and stays NaN
                xw = tl.where(x > limit, limit, tl.where(x < -limit, -limit, x))
            if BF16:   # round to nearest even by hand: the interpreter's cast truncates
                wbits = xw.to(tl.int32, bitcast=True)
                up = (wbits + 0x7FFF + ((wbits >> 16) & 1)) & -65536
                up = tl.where((wbits & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, up)   # NaN: torch's quiet NaN
                wire = up.to(tl.float32, bitcast=True).to(tl.bfloat16)
            else:
                wire = xw.to(val_ptr.dtype.element_ty)
            tl.store(val_ptr + at, wire, mask=take)
            sent = wire.to(tl.float32)
        if UPDATE:
            tl.store(x_ptr + offs, x - sent, mask=take)
        if VELOCITY:
            tl.store(u_ptr + offs, tl.zeros_like(x), mask=take)
        slot += tl.sum(ti, 0)
        eq_seen += tl.sum(eq, 0)


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


# ---- launchers ------------------------------------------------------------------------------

def pass1(seg: Segments, x: torch.Tensor, R: int, *, residual=None, grad=None, velocity=None,
          velocity_out=None, momentum: float = 0.0, nesterov: bool = False) -> torch.Tensor:
    """Histogram 1 of x ((L*R, 256) int32), computing x = compensated residual first when
    ``residual`` is given."""
    tab = seg.tables(x.device)
    hist = torch.zeros(len(seg) * R, BINS[0], dtype=torch.int32, device=x.device)
    grid = (tab.tile_seg.numel(),)
    if grid[0]:
        comp, mom = residual is not None, velocity is not None
        _pass1[grid](x, residual if comp else x, grad if comp else x, velocity if mom else x,
                     velocity_out if mom else x, hist, tab.tile_seg, tab.tile_lo, tab.tile_hi,
                     float(momentum), COMPENSATE=comp, MOMENTUM=mom, NESTEROV=bool(nesterov), R=R,
                     BLOCK=_block(seg), num_warps=_WARPS, enable_fp_fusion=False)
    return hist


def select(seg: Segments, x: torch.Tensor, R: int, active, k_row: torch.Tensor, hist: torch.Tensor | None,
           index_dtype: torch.dtype, value_dtype: torch.dtype, mean: bool, update: bool,
           velocity: torch.Tensor | None):
    """The launches of one bucket's selection; returns what ``radix_select.select`` unpacks."""
    L, K, dev, block = len(seg), seg.k_total, x.device, _block(seg)
    tab = seg.tables(dev)
    T = tab.tile_seg.numel()
    tiles, LR = (T,), L * R
    rows = 1 if x.is_cuda else _INTERPRETER_ROWS
    # one zeroed workspace: prefix (becomes T), need, other-side count, flags, histograms 2 and 3
    ws = torch.zeros(3 * LR + L + LR * (BINS[1] + BINS[2]), dtype=torch.int32, device=dev)
    prefix, need, zeros = ws[:LR], ws[LR:2 * LR], ws[2 * LR:3 * LR]
    bad = ws[3 * LR:3 * LR + L].view(torch.int8)[:L]   # the first L bytes of the flag words
    hists = [hist if hist is not None else pass1(seg, x, R),
             ws[3 * LR + L:3 * LR + L + LR * BINS[1]], ws[3 * LR + L + LR * BINS[1]:]]
    for level in range(3):
        if level and T:
            _refine[tiles](x, hists[level], prefix, tab.tile_seg, tab.tile_lo, tab.tile_hi, R=R, B=BINS[level],
                           SHIFT=SHIFTS[level], PSHIFT=SHIFTS[level - 1], BLOCK=block, num_warps=_WARPS)
        _choose[(triton.cdiv(LR, rows),)](hists[level], k_row, prefix, need, zeros, bad, LR, LEVEL=level, R=R,
                                          B=BINS[level], SHIFT=SHIFTS[level], NONFINITE=NONFINITE_BIN, ROWS=rows,
                                          num_warps=4)
    s0, s1 = active[0], active[-1]
    mags = mean or s1 != s0
    cnt = torch.empty(max(T, 1) * R * 2, dtype=torch.int32, device=dev)
    sums = torch.empty(max(T, 1) * R, dtype=torch.float64, device=dev)
    base = torch.empty(max(T, 1) * 2, dtype=torch.int32, device=dev)
    means = torch.empty(L, dtype=torch.float32, device=dev)
    side = torch.empty(L, dtype=torch.int8, device=dev)
    kth = torch.empty(L, dtype=torch.int32, device=dev)
    pos = torch.empty(K, dtype=index_dtype, device=dev)
    vals = torch.empty(K, dtype=value_dtype, device=dev)
    if T:
        _count[tiles](x, prefix, cnt, sums, tab.tile_seg, tab.tile_lo, tab.tile_hi, S0=s0, S1=s1, R=R,
                      MAGS=mags, BLOCK=block, num_warps=_WARPS)
    _scan[(triton.cdiv(L, rows),)](cnt, sums, prefix, need, tab.kofs, tab.seg_tile, base, means, side, kth, L,
                                   S0=s0, S1=s1, R=R, MAGS=mags, ROWS=rows, BLOCK=_SMALL, num_warps=4)
    if T:
        _write[tiles](x, velocity if velocity is not None else x, prefix, need, base, side, means, tab.offsets,
                      tab.kofs, pos, vals, tab.tile_seg, tab.tile_lo, tab.tile_hi, wire_limit(value_dtype), R=R,
                      MEAN=mean, UPDATE=update, VELOCITY=velocity is not None, BF16=value_dtype == torch.bfloat16,
                      CLAMP=value_dtype != torch.float32, BLOCK=block, num_warps=_WARPS,
                      enable_fp_fusion=False)
    return pos, vals, means if mags else None, bad.bool(), kth, side


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
