"""The Triton kernels of ``triton_select.py`` (launchers, workspace and the order of the stages there).

A program owns one tile (a run of at most ``Segments.tile`` elements inside one layer) and
loops over it in blocks. Three of the stages end with the per-layer work of the stage after
them, done by the last of the layer's programs to finish (an arrival counter per layer, as
AIR top-k does): the choice of a digit's bin, the means, the scan of the tiles' counts. The filter
keeps, per tile and in position order, the elements that can still be selected (those in or
above the chosen bin of the first digit: a few percent of a gradient) in a buffer of static
size; the later stages read those, or, where a tile had more than its buffer holds, the tile
again (``spill``). With ``ALIGNED`` (``Segments(align=16)``) tile starts are multiples of 16
elements and loads cover whole vectors up to the next multiple of 16 (padding, never counted).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

ABS = tl.constexpr(0x7FFFFFFF)   # the bits of |x|


def _device(fn):
    """A device function the kernels call: ``triton.jit`` (inlined when compiled); in Triton's
    interpreter the plain function, run with the calling kernel's patched ``triton.language``
    (a nested interpreted call patches it again, about 10 ms a call)."""
    return fn if os.environ.get("TRITON_INTERPRET", "0") == "1" else triton.jit(fn)


# ---- helpers ----------------------------------------------------------------------------

@_device
def _tile(tile_seg, tile_lo, tile_hi, t, ALIGNED: tl.constexpr):
    """The tile's layer, first element, end, and the end of its loads (the end rounded up to
    the vector width when layers are aligned: the padding up to there is loaded, never used)."""
    seg = tl.load(tile_seg + t)
    lo = tl.load(tile_lo + t)
    hi = tl.load(tile_hi + t)
    if ALIGNED:
        lo = tl.multiple_of(lo, 16)
        end = tl.multiple_of((hi + 15) // 16 * 16, 16)
    else:
        end = hi
    return seg, lo, hi, end


@_device
def _pair(v, R: tl.constexpr):
    """The values of a layer's R rows (R = 1 or 2) as two scalars (row 0, row R-1)."""
    if R == 2:
        return tl.split(v)
    s = tl.sum(v, 0)
    return s, s


@_device
def _bin(h, need, prefix, zeros, B: tl.constexpr, SIDED: tl.constexpr):
    """Per row of h (rows x B): the bin b holding the need-th largest key, and h as counted
    (sided rows count the other side's elements as key 0 while the prefix is 0)."""
    bins = tl.arange(0, B)[None, :]
    if SIDED:
        h = h + tl.where((bins == 0) & (prefix[:, None] == 0), zeros[:, None], 0)
    c = tl.cumsum(h, 1, reverse=True)
    return h, tl.maximum(tl.sum((c >= need[:, None]).to(tl.int32), 1) - 1, 0)


@_device
def _pick(h, need, prefix, zeros, B: tl.constexpr, SHIFT: tl.constexpr, SIDED: tl.constexpr):
    """Per row: the new (prefix, need) after choosing the bin of the need-th largest key."""
    h, b = _bin(h, need, prefix, zeros, B, SIDED)
    above = tl.sum(tl.where(tl.arange(0, B)[None, :] > b[:, None], h, 0), 1)
    return prefix | (b << SHIFT), need - above


@_device
def _tally(hist, b, match, NB: tl.constexpr):
    """hist[b] += 1 for every match, with global atomics: one for all of the block's smallest
    bin, one for its largest, one per element for the rest (a layer of zeros, or of a few
    quantised values, would otherwise send every element to one address)."""
    first = tl.min(tl.where(match, b, NB), 0)
    last = tl.max(tl.where(match, b, -1), 0)
    n_first = tl.sum((match & (b == first)).to(tl.int32), 0)
    n_last = tl.sum((match & (b == last) & (b != first)).to(tl.int32), 0)
    tl.atomic_add(hist + first, n_first, mask=n_first > 0, sem="relaxed")
    tl.atomic_add(hist + last, n_last, mask=n_last > 0, sem="relaxed")
    tl.atomic_add(hist + b, tl.full(b.shape, 1, tl.int32), mask=match & (b != first) & (b != last), sem="relaxed")


@_device
def _last_of_layer(arrivals, seg_tile, seg):
    """Whether this program is the last of its layer's to get here: all the others' writes
    are then visible to it (their atomics before a barrier, then a release; here an acquire).
    The last one sets the counter back to 0 for the next launch."""
    tl.debug_barrier()
    done = tl.atomic_add(arrivals + seg, 1, sem="acq_rel")
    last = done == tl.load(seg_tile + seg + 1) - tl.load(seg_tile + seg) - 1
    if last:
        tl.store(arrivals + seg, 0)
    return last


@_device
def _source(cand_lo, cand_n, t, lo, end, ALIGNED: tl.constexpr):
    """Where a tile's candidates are: (first slot, how many, spilled: more than its buffer
    holds, so the stages read the tile itself, and the loop length)."""
    c0 = tl.load(cand_lo + t)
    if ALIGNED:
        c0 = tl.multiple_of(c0, 16)
    nc = tl.load(cand_n + t)
    spill = nc > tl.load(cand_lo + t + 1) - c0
    return c0, nc, spill, tl.where(spill, end - lo, nc)


@_device
def _elements(x_ptr, cand_bits, cand_pos, c0, nc, lo, hi, spill, j, BLOCK: tl.constexpr):
    """Block j of a tile's candidates in position order: (float32 bits, offset in the tile,
    mask); the tile's elements themselves where it spilled."""
    i = j + tl.arange(0, BLOCK)
    if spill:
        offs = lo + i
        m = offs < hi
        bits = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
        local = i.to(tl.int32)
    else:
        m = i < nc
        load = i < (nc + 15) // 16 * 16       # the buffer is 16-aligned: whole vectors
        bits = tl.where(m, tl.load(cand_bits + c0 + i, mask=load, other=0), 0)   # past nc: stale slots
        local = tl.load(cand_pos + c0 + i, mask=load, other=0)
    return bits, local, m


@_device
def _row_key(bits, side, R: tl.constexpr):
    """The key of each element in a row of side ``side``: |x|'s bits, 0 on the other side."""
    key = bits & ABS
    if R == 2:
        key = tl.where((bits < 0).to(tl.int32) == side, key, 0)
    return key


# ---- compensation and histogram 1 ----------------------------------------------------------

@triton.jit
def _pass1(x_ptr, r_ptr, g_ptr, u_ptr, uo_ptr, hist_ptr, tile_seg, tile_lo, tile_hi, momentum,
           COMPENSATE: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
           R: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """1. x = r + g (DGC: u' = g + m*u; x = r + u', nesterov r + (g + m*u'): the Triton form of
    ``core/compensate.py:torch_compensate`` with ``fma=False``), stored (0 in the
    padding), or x loaded; 2. bin = the exponent of |x| (+256 for negative x when R == 2);
    3. the tile's histogram; 4. one atomic add per non-empty bin."""
    NB: tl.constexpr = R * 256
    seg, lo, hi, end = _tile(tile_seg, tile_lo, tile_hi, tl.program_id(0), ALIGNED)
    h = tl.zeros([NB], dtype=tl.int32)
    for start in range(lo, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m, valid = offs < end, offs < hi
        if COMPENSATE:
            g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
            r = tl.load(r_ptr + offs, mask=m, other=0.0)
            if MOMENTUM:
                u = g + momentum * tl.load(u_ptr + offs, mask=m, other=0.0)
                tl.store(uo_ptr + offs, tl.where(valid, u, 0.0), mask=m)
                if NESTEROV:
                    x = r + (g + momentum * u)
                else:
                    x = r + u
            else:
                x = r + g
            tl.store(x_ptr + offs, tl.where(valid, x, 0.0), mask=m)
        else:
            x = tl.load(x_ptr + offs, mask=m, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        b = (bits & ABS) >> 23
        if R == 2:
            b += (bits < 0).to(tl.int32) * 256
        h += tl.histogram(b, NB, mask=valid)
    tl.atomic_add(hist_ptr + seg * NB + tl.arange(0, NB), h, mask=h > 0)


# ---- the filter: candidates and histogram 2; the last program per layer picks digits 1-2 -----

@_device
def _classify(bits, valid, b0_0, b0_1, R: tl.constexpr):
    """Per element: (a candidate: its key on a row selected from is in or above that row's
    level-1 bin b0, or it is a key 0 that a row whose b0 is 0 may take; in a row's bin b0, so
    counted in histogram 2; its bin there: side * 4096 + the key's bits 22..11)."""
    key = bits & ABS
    e = key >> 23
    digit = (key >> 11) & 4095
    if R == 2:
        side = (bits < 0).to(tl.int32)
        own = tl.where(side == 1, b0_1, b0_0)
        other = tl.where(side == 1, b0_0, b0_1)
        cand = valid & ((e >= own) | (other == 0))
        return cand, valid & (e == own), digit + side * 4096
    return valid & (e >= b0_0), valid & (e == b0_0), digit


@_device
def _first_bins(hist1, k_ptr, rows, S0: tl.constexpr, S1: tl.constexpr, R: tl.constexpr):
    """The layer's rows' histogram 1, their other-side counts and each row's level-1 bin b0
    (256, matching no key, for a row not selected from)."""
    h1 = tl.load(hist1 + rows[:, None] * 256 + tl.arange(0, 256)[None, :])
    if R == 2:
        total = tl.sum(h1, 1)
        zeros = tl.sum(total, 0) - total      # the other side's elements, key 0 in this row
    else:
        zeros = tl.zeros([R], tl.int32)
    _, b0 = _bin(h1, tl.load(k_ptr + rows), tl.zeros([R], tl.int32), zeros, 256, R == 2)
    r = tl.arange(0, R)
    return h1, zeros, tl.where((r == S0) | (r == S1), b0, 256)


@_device
def _second_choice(hist1, hist2, h1, k_ptr, rows, zeros, prefix_ptr, need_ptr, zeros_ptr, bad_ptr, seg,
                   NONFINITE: tl.constexpr, CLEAR1: tl.constexpr, R: tl.constexpr):
    """The last program of a layer: 1. the non-finite flag (histogram 1's top bin); 2. digits
    1 and 2: the rows' (prefix, need, other-side count) for the stages after; 3. histogram 2
    (and histogram 1, when it is the workspace's) zeroed for the next step."""
    bins = tl.arange(0, 256)[None, :]
    tl.store(bad_ptr + seg, tl.sum(tl.sum(tl.where(bins >= NONFINITE, h1, 0), 1), 0) > 0)
    prefix, need = _pick(h1, tl.load(k_ptr + rows), tl.zeros_like(zeros), zeros, 256, 23, R == 2)
    at = rows[:, None] * 4096 + tl.arange(0, 4096)[None, :]
    h2 = tl.load(hist2 + at, cache_modifier=".cg")
    prefix, need = _pick(h2, need, prefix, zeros, 4096, 11, R == 2)
    tl.store(prefix_ptr + rows, prefix)
    tl.store(need_ptr + rows, need)
    tl.store(zeros_ptr + rows, zeros)
    tl.store(hist2 + at, tl.zeros_like(h2))
    if CLEAR1:
        tl.store(hist1 + rows[:, None] * 256 + bins, tl.zeros_like(h1))


@triton.jit
def _filter(x_ptr, hist1, hist2, k_ptr, prefix_ptr, need_ptr, zeros_ptr, arrivals, bad_ptr, cand_bits, cand_pos,
            cand_lo, cand_n, tile_seg, tile_lo, tile_hi, seg_tile, NONFINITE: tl.constexpr, CLEAR1: tl.constexpr,
            S0: tl.constexpr, S1: tl.constexpr, R: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """1. digit 1's bin per row from histogram 1 (each program of the layer computes it);
    2. the tile's candidates, in position order, into its buffer (their count even where they
    do not fit: the stages after then read the tile); 3. histogram 2 of those in the bin;
    4. the layer's last program: ``_second_choice``."""
    t = tl.program_id(0)
    seg, lo, hi, end = _tile(tile_seg, tile_lo, tile_hi, t, ALIGNED)
    rows = seg * R + tl.arange(0, R)
    h1, zeros, b0 = _first_bins(hist1, k_ptr, rows, S0, S1, R)                        # 1.
    b0_0, b0_1 = _pair(b0, R)
    c0 = tl.load(cand_lo + t)
    cap = tl.load(cand_lo + t + 1) - c0
    count = tl.full([], 0, tl.int32)
    for start in range(lo, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        bits = tl.load(x_ptr + offs, mask=offs < end, other=0.0).to(tl.int32, bitcast=True)
        cand, match, b2 = _classify(bits, offs < hi, b0_0, b0_1, R)
        ci = cand.to(tl.int32)
        at = count + tl.cumsum(ci, 0) - ci                                          # 2.
        keep = cand & (at < cap)
        tl.store(cand_bits + c0 + at, bits, mask=keep)
        tl.store(cand_pos + c0 + at, (offs - lo).to(tl.int32), mask=keep)
        count += tl.sum(ci, 0)
        _tally(hist2 + seg * R * 4096, b2, match, R * 4096)                           # 3.
    tl.store(cand_n + t, count)
    if _last_of_layer(arrivals, seg_tile, seg):                                         # 4.
        _second_choice(hist1, hist2, h1, k_ptr, rows, zeros, prefix_ptr, need_ptr, zeros_ptr, bad_ptr, seg,
                       NONFINITE, CLEAR1, R)


# ---- refine: histogram 3 over the candidates; the last program: T, the means, the side -------

@_device
def _magnitudes(sums, h3, rows, prefix, T, need, k, seg_tile, seg, R: tl.constexpr):
    """Each row's mean key over its k, in float64: (sum of keys above T + need * T) / k. The
    keys above T are the candidates above digit 2's bin (summed per tile by ``_refine``) and
    those of digit 3's bins above T's (each bin is one key: count * key)."""
    first, last = tl.load(seg_tile + seg), tl.load(seg_tile + seg + 1)
    r = tl.arange(0, R)
    s = tl.zeros([R], tl.float64)
    for j in range(first, last, 256):
        tt = j + tl.arange(0, 256)
        s += tl.sum(tl.load(sums + tt[:, None] * R + r[None, :], mask=(tt < last)[:, None], other=0.0,
                            cache_modifier=".cg"), 0)
    d = tl.arange(0, 2048)[None, :]
    keys = (prefix[:, None] | d).to(tl.float32, bitcast=True).to(tl.float64)
    s += tl.sum(tl.where(d > (T & 2047)[:, None], h3.to(tl.float64) * keys, 0.0), 1)
    at_t = tl.where(need > 0, need.to(tl.float64) * T.to(tl.float32, bitcast=True).to(tl.float64), 0.0)
    return (s + at_t) / tl.maximum(k, 1).to(tl.float64)


@_device
def _third_choice(hist3, rows, k_ptr, prefix_ptr, need_ptr, zeros_ptr, sums, mean_ptr, side_ptr, kth_ptr,
                  seg_tile, seg, S0: tl.constexpr, S1: tl.constexpr, R: tl.constexpr, MAGS: tl.constexpr):
    """The last program of a layer: 1. digit 3's bin: T, the k-th largest key, and need per
    row; 2. with MAGS the rows' mean magnitudes and the kept side (SBC: the larger, ties
    positive); its signed mean; 3. the kept side and its T; histogram 3 zeroed."""
    at = rows[:, None] * 2048 + tl.arange(0, 2048)[None, :]
    h3 = tl.load(hist3 + at, cache_modifier=".cg")
    prefix = tl.load(prefix_ptr + rows)
    T, need = _pick(h3, tl.load(need_ptr + rows), prefix, tl.load(zeros_ptr + rows), 2048, 0, R == 2)
    tl.store(prefix_ptr + rows, T)
    tl.store(need_ptr + rows, need)
    tl.store(hist3 + at, tl.zeros_like(h3))
    side = tl.full([], S0, tl.int32)
    if MAGS:
        mag = _magnitudes(sums, h3, rows, prefix, T, need, tl.load(k_ptr + rows), seg_tile, seg, R)
        mag0, mag1 = _pair(mag, R)
        if S1 != S0:
            side = (mag1 > mag0).to(tl.int32)
        tl.store(mean_ptr + seg, tl.where(side == 1, -mag1, mag0).to(tl.float32))
    tl.store(side_ptr + seg, side.to(tl.int8))
    T0, T1 = _pair(T, R)
    tl.store(kth_ptr + seg, tl.where(side == 1, T1, T0))


@triton.jit
def _refine(x_ptr, hist3, k_ptr, prefix_ptr, need_ptr, zeros_ptr, arrivals, sums, mean_ptr, side_ptr, kth_ptr,
            cand_bits, cand_pos, cand_lo, cand_n, tile_seg, tile_lo, tile_hi, seg_tile, S0: tl.constexpr,
            S1: tl.constexpr, R: tl.constexpr, MAGS: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Over the tile's candidates: 1. histogram 3 of those whose key's bits 30..11 equal their
    row's prefix; 2. with MAGS, per row the float64 sum of the keys above it; 3. the layer's
    last program: ``_third_choice``."""
    t = tl.program_id(0)
    seg, lo, hi, end = _tile(tile_seg, tile_lo, tile_hi, t, ALIGNED)
    rows = seg * R + tl.arange(0, R)
    r = tl.arange(0, R)
    p = tl.where((r == S0) | (r == S1), tl.load(prefix_ptr + rows) >> 11, -1)   # -1: not selected from
    p_0, p_1 = _pair(p, R)
    c0, nc, spill, length = _source(cand_lo, cand_n, t, lo, end, ALIGNED)
    above0, above1 = tl.zeros([BLOCK], tl.float64), tl.zeros([BLOCK], tl.float64)
    for j in range(0, length, BLOCK):
        bits, local, m = _elements(x_ptr, cand_bits, cand_pos, c0, nc, lo, hi, spill, j, BLOCK)
        key = bits & ABS
        side = (bits < 0).to(tl.int32) if R == 2 else tl.zeros_like(bits)
        own = tl.where(side == 1, p_1, p_0)
        _tally(hist3 + seg * R * 2048, (key & 2047) + side * 2048, m & ((key >> 11) == own), R * 2048)   # 1.
        if MAGS:                                                                                       # 2.
            v = tl.where(m & (own >= 0) & ((key >> 11) > own), key.to(tl.float32, bitcast=True), 0.0)
            above0 += tl.where(side == 0, v, 0.0).to(tl.float64)
            above1 += tl.where(side == 1, v, 0.0).to(tl.float64)
    if MAGS:
        tl.store(sums + t * R, tl.sum(above0, 0))
        tl.store(sums + t * R + R - 1, tl.sum(above1, 0))
    if _last_of_layer(arrivals, seg_tile, seg):                                                          # 3.
        _third_choice(hist3, rows, k_ptr, prefix_ptr, need_ptr, zeros_ptr, sums, mean_ptr, side_ptr, kth_ptr,
                      seg_tile, seg, S0, S1, R, MAGS)


# ---- count, scan, write --------------------------------------------------------------------

@_device
def _scan_tiles(cnt_ptr, base_ptr, seg_tile, seg, need, SCAN: tl.constexpr):
    """The last program of a layer: per tile, exclusive prefix sums of the kept row's
    above/equal counts: its first output slot = keys above T before it + min(keys equal to
    T before it, need), and the keys equal to T before it."""
    first, last = tl.load(seg_tile + seg), tl.load(seg_tile + seg + 1)
    carry_gt = tl.full([], 0, tl.int32)
    carry_eq = tl.full([], 0, tl.int32)
    for j in range(first, last, SCAN):
        tt = j + tl.arange(0, SCAN)
        m = tt < last
        gt = tl.load(cnt_ptr + tt * 2, mask=m, other=0, cache_modifier=".cg")
        eq = tl.load(cnt_ptr + tt * 2 + 1, mask=m, other=0, cache_modifier=".cg")
        eq_before = carry_eq + tl.cumsum(eq, 0) - eq
        tl.store(base_ptr + tt * 2, carry_gt + tl.cumsum(gt, 0) - gt + tl.minimum(eq_before, need), mask=m)
        tl.store(base_ptr + tt * 2 + 1, eq_before, mask=m)
        carry_gt += tl.sum(gt, 0)
        carry_eq += tl.sum(eq, 0)


@triton.jit
def _count(x_ptr, prefix_ptr, need_ptr, side_ptr, arrivals, cnt_ptr, base_ptr, cand_bits, cand_pos, cand_lo, cand_n,
           tile_seg, tile_lo, tile_hi, seg_tile, R: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Over the tile's candidates, for its layer's kept row: 1. how many keys are above T and
    how many equal it; 2. the layer's last program: ``_scan_tiles``."""
    t = tl.program_id(0)
    seg, lo, hi, end = _tile(tile_seg, tile_lo, tile_hi, t, ALIGNED)
    side = tl.load(side_ptr + seg).to(tl.int32)
    thr = tl.load(prefix_ptr + seg * R + side)
    c0, nc, spill, length = _source(cand_lo, cand_n, t, lo, end, ALIGNED)
    gt, eq = tl.zeros([BLOCK], tl.int32), tl.zeros([BLOCK], tl.int32)
    for j in range(0, length, BLOCK):
        bits, local, m = _elements(x_ptr, cand_bits, cand_pos, c0, nc, lo, hi, spill, j, BLOCK)
        key = _row_key(bits, side, R)
        gt += (m & (key > thr)).to(tl.int32)
        eq += (m & (key == thr)).to(tl.int32)
    tl.store(cnt_ptr + t * 2, tl.sum(gt, 0))
    tl.store(cnt_ptr + t * 2 + 1, tl.sum(eq, 0))
    if _last_of_layer(arrivals, seg_tile, seg):
        _scan_tiles(cnt_ptr, base_ptr, seg_tile, seg, tl.load(need_ptr + seg * R + side), 1024)


@_device
def _wire(x, bits, val_ptr, at, take, limit, BF16: tl.constexpr, CLAMP: tl.constexpr):
    """Store x's values at slots ``at`` in the wire's dtype; returns them as float32 (what
    receivers decode): the Triton form of ``core/wire.py:to_wire`` (its torch reference; the
    tests compare them bit for bit). CLAMP: first clamped to +-limit, the wire type's finite
    range, so a finite value stays finite (NaN compares false and stays)."""
    if CLAMP:
        x = tl.where(x > limit, limit, tl.where(x < -limit, -limit, x))
        bits = x.to(tl.int32, bitcast=True)
    if BF16:   # round to nearest even by hand: the interpreter's cast truncates
        up = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        up = tl.where((bits & ABS) > 0x7F800000, 0x7FC00000, up)   # NaN: torch's quiet NaN
        wire = up.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        wire = x.to(val_ptr.dtype.element_ty)
    tl.store(val_ptr + at, wire, mask=take)
    return wire.to(tl.float32)


@triton.jit
def _write(x_ptr, u_ptr, prefix_ptr, need_ptr, base_ptr, side_ptr, mean_ptr, offsets, kofs, pos_ptr, val_ptr,
           cand_bits, cand_pos, cand_lo, cand_n, tile_seg, tile_lo, tile_hi, limit, R: tl.constexpr,
           MEAN: tl.constexpr, UPDATE: tl.constexpr, VELOCITY: tl.constexpr, BF16: tl.constexpr,
           CLAMP: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Over the tile's candidates, for its layer's kept row: 1. take the keys above T and those
    equal to T whose rank among equals (position order, counted from the tile's base) is below
    need; 2. write their layer-local positions, and values in the wire's dtype (clamped to its
    finite range), at consecutive
    slots from the tile's first slot; 3. with UPDATE, x -= what receivers decode (the value as
    sent, or the layer's mean), in the same pass; with VELOCITY, u = 0 there."""
    t = tl.program_id(0)
    seg, lo, hi, end = _tile(tile_seg, tile_lo, tile_hi, t, ALIGNED)
    side = tl.load(side_ptr + seg).to(tl.int32)
    thr, need = tl.load(prefix_ptr + seg * R + side), tl.load(need_ptr + seg * R + side)
    first = lo - tl.load(offsets + seg)           # the tile's first position in its layer
    slot = tl.load(kofs + seg) + tl.load(base_ptr + t * 2)
    eq_seen = tl.load(base_ptr + t * 2 + 1)
    mean = tl.load(mean_ptr + seg) if MEAN else 0.0
    c0, nc, spill, length = _source(cand_lo, cand_n, t, lo, end, ALIGNED)
    for j in range(0, length, BLOCK):
        bits, local, m = _elements(x_ptr, cand_bits, cand_pos, c0, nc, lo, hi, spill, j, BLOCK)
        key = _row_key(bits, side, R)
        eq = (m & (key == thr)).to(tl.int32)
        take = (m & (key > thr)) | ((eq == 1) & (eq_seen + tl.cumsum(eq, 0) - eq < need))     # 1.
        ti = take.to(tl.int32)
        at = slot + tl.cumsum(ti, 0) - ti
        tl.store(pos_ptr + at, (first + local).to(pos_ptr.dtype.element_ty), mask=take)       # 2.
        x = bits.to(tl.float32, bitcast=True)
        sent = mean if MEAN else _wire(x, bits, val_ptr, at, take, limit, BF16, CLAMP)
        if UPDATE:                                                                            # 3.
            tl.store(x_ptr + lo + local, x - sent, mask=take)
        if VELOCITY:
            tl.store(u_ptr + lo + local, tl.zeros_like(x), mask=take)
        slot += tl.sum(ti, 0)
        eq_seen += tl.sum(eq, 0)
