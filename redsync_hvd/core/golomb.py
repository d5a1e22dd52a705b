"""Golomb-Rice coding of sorted sparse-gradient positions (SBC position coding).

Why
---
A sparsified gradient is sent as (values, positions).  Sending a position as an
``int32`` costs 32 bits.  Sparse Binary Compression (Sattler et al., 2018)
instead codes the *gaps* between sorted positions with a Golomb-Rice code.  If
each of the ``n`` elements of a layer is selected independently with
probability ``p`` the gaps are geometric, and a Rice code with parameter
``2**b*`` where::

    b* = 1 + floor(log2( ln(phi - 1) / ln(1 - p) )),   phi = (1 + sqrt 5) / 2

is (close to) optimal, with an expected cost per position of::

    b* + 1 / (1 - (1 - p) ** (2 ** b*))   bits.

========  ====  =========================  ==================
p         b*    expected bits / position   vs int32 positions
========  ====  =========================  ==================
0.01      6     8.11                       3.9x smaller
0.001     9     11.50                      2.8x smaller
========  ====  =========================  ==================

The trade-off: the stream is ~4x smaller than raw ``int32`` indices at p=0.01,
but it is variable length and has to be parsed (the decoder cannot jump to the
i-th position), and it only compresses well when ``b`` matches the density.

Wire format (one bit stream, no header)
---------------------------------------
``positions`` must be sorted, unique and non-negative.  Gaps are
``d_i = pos_i - pos_{i-1}`` with ``pos_{-1} = -1`` so every ``d_i >= 1``; the
coded value is ``v_i = d_i - 1 >= 0``.  For each position, in order:

1. the quotient ``q_i = v_i >> b`` in unary, written as ``q_i`` **zero** bits
   followed by a single terminating **one** bit;
2. the remainder ``v_i & (2**b - 1)`` as exactly ``b`` bits, most significant
   bit first (nothing when ``b == 0``).

So each position costs exactly ``q_i + 1 + b`` bits.  The codes are
concatenated and the bits are packed most-significant-bit first into bytes
(``np.packbits`` order); the final byte is zero-padded.  The number of
positions (``count``) and ``b`` are *not* in the stream: the caller carries them
in its message header.

Choosing "zeros then a one" (rather than "ones then a zero") for the unary part
makes the stream mostly zero bits: the encoder only has to set the
``count * (1 + b/2)``-ish one bits into a zero buffer, never fill unary runs, so
its cost does not depend on how long the gaps are.

Implementation
--------------
Everything is vectorised with numpy; there is no per-bit or per-position Python
loop (the only Python loops run over at most ``b + 1`` bit/byte columns or over
O(log count) doubling rounds).

* Encode: gaps, quotients and terminator positions come from ``diff`` /
  ``cumsum``.  Each code's (b+1)-bit tail ``1 r_{b-1}..r_0`` is shifted into a
  uint64 window aligned on its first byte, split into byte columns, and the
  columns are OR-reduced over codes sharing a byte (``np.bitwise_or.reduceat``)
  into a zero buffer.  Time and memory are O(count * b/8 + payload bytes).
* Decode: ``np.unpackbits`` + ``flatnonzero`` give the one bits.  Which of them
  are unary terminators, as opposed to remainder bits that happen to be 1, is
  a sequential property: after a terminator at bit ``t`` the next code starts
  at ``t + 1 + b`` and its terminator is the first one bit at or after that.
  This "next terminator" map ``g`` over the one bits is a single gather into
  the running count (``cumsum``) of the bits.  The first one bit is always a
  terminator, so the terminators are the chain ``0, g(0), g(g(0)), ...``,
  extracted by pointer doubling (``J <- J[J]``; ``ceil(log2 count)`` gathers)
  combined with graph reduction: the rest of the chain lies in the image of
  ``J``, false parses started inside remainders merge into the true one after
  a few codes (Rice codes self-synchronise), so the image shrinks to exactly
  the chain after ~6 rounds and the search stops there (see ``_chain``; the
  exact worst case, streams whose false parses never merge, is plain
  doubling).  Quotients follow from the terminator positions, remainders are
  cut out of uint64 windows by index arithmetic, positions are a ``cumsum``.

Typical 2-core CPU numbers (``scripts/bench_golomb.py``, ``docs/benchmarks.md``):
encode ~20-40 M positions/s, decode ~2-9 M positions/s (16M-element layer at
p=0.1: 1.6M positions encode in 73 ms, decode in 216 ms).

Where the native module is built (``core/_native/golomb_kernels.cpp``, b <= 56),
``encode`` and ``decode`` run it instead: the same bytes, read and written one
code after the other, at ~170 M positions/s both ways (9 ms each for those 1.6M
positions). numpy stays the reference, and decodes every payload the native
coder calls corrupt, so its error is the one raised.

Public API
----------
``optimal_b``, ``expected_bits``, ``encoded_bits``, ``encode``, ``decode``,
``choose_b``, and the convenience pair ``encode_positions`` /
``decode_positions`` used by the compressors (``b`` is chosen from the density
``count / numel``; the header must carry ``count`` and ``b``).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import numpy as np
import torch

__all__ = [
    "MAX_B",
    "MAX_PAYLOAD_BYTES",
    "optimal_b",
    "expected_bits",
    "encoded_bits",
    "encode",
    "decode",
    "choose_b",
    "encode_positions",
    "decode_positions",
]

#: Largest supported Rice parameter (positions are int64, so v < 2**63).
MAX_B = 62

#: ``encode`` refuses to build a payload larger than this (a huge gap coded
#: with a tiny ``b`` would need ~gap / 2**b bits); pick a larger ``b`` instead.
MAX_PAYLOAD_BYTES = 1 << 31

_PHI = (1.0 + math.sqrt(5.0)) / 2.0
_LN_PHI_MINUS_1 = math.log(_PHI - 1.0)  # ln(0.618...) < 0

ArrayLike = Union[torch.Tensor, np.ndarray, list, tuple]


# --------------------------------------------------------------------------- #
# Parameter choice and cost model
# --------------------------------------------------------------------------- #
def optimal_b(p: float) -> int:
    """Optimal Rice parameter exponent for density ``p`` (Sattler et al.).

    ``b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p)))``, clamped to ``>= 0``.

    >>> optimal_b(0.01), optimal_b(0.001)
    (6, 9)

    Raises ``ValueError`` unless ``0 < p < 1``.
    """
    p = float(p)
    if not (0.0 < p < 1.0) or math.isnan(p):
        raise ValueError(f"optimal_b: density p must be in (0, 1), got {p!r}")
    ratio = _LN_PHI_MINUS_1 / math.log1p(-p)  # both logs negative -> ratio > 0
    b = 1 + math.floor(math.log2(ratio))
    return int(min(max(b, 0), MAX_B))


def expected_bits(p: float, b: Optional[int] = None) -> float:
    """Expected Golomb-Rice bits per position for i.i.d. density ``p``.

    ``b + 1 / (1 - (1 - p) ** (2 ** b))``; ``b`` defaults to ``optimal_b(p)``.
    (p=0.01 -> 8.11 bits, p=0.001 -> 11.50 bits, vs 32 for int32 indices.)
    """
    p = float(p)
    if not (0.0 < p <= 1.0) or math.isnan(p):
        raise ValueError(f"expected_bits: density p must be in (0, 1], got {p!r}")
    if b is None:
        b = optimal_b(p) if p < 1.0 else 0
    b = _check_b(b)
    # (1-p)**(2**b) computed in log space to stay accurate for large b.
    x = math.exp((2.0 ** b) * math.log1p(-p)) if p < 1.0 else 0.0
    return b + 1.0 / (1.0 - x)


# --------------------------------------------------------------------------- #
# Input handling
# --------------------------------------------------------------------------- #
def _check_b(b) -> int:
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
        raise ValueError(f"Rice parameter b must be an int, got {b!r}")
    b = int(b)
    if not 0 <= b <= MAX_B:
        raise ValueError(f"Rice parameter b must be in [0, {MAX_B}], got {b}")
    return b


def _as_positions(positions: ArrayLike) -> np.ndarray:
    """Validate and return positions as a 1-D contiguous int64 numpy array."""
    if isinstance(positions, torch.Tensor):
        if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
            raise ValueError(f"positions must be an integer tensor, got dtype {positions.dtype}")
        arr = positions.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(positions)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"positions must be integers, got dtype {arr.dtype}")
        if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise ValueError("positions do not fit in int64")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim != 1:
        if arr.ndim == 0:
            raise ValueError("positions must be a 1-D sequence, got a scalar")
        raise ValueError(f"positions must be 1-D, got shape {tuple(arr.shape)}")
    arr = np.ascontiguousarray(arr)
    if arr.size:
        if arr[0] < 0:
            raise ValueError(f"positions must be non-negative, got {int(arr[0])} at index 0")
        d = np.diff(arr)
        bad = np.flatnonzero(d <= 0)
        if bad.size:
            i = int(bad[0])
            kind = "duplicate" if d[i] == 0 else "unsorted"
            raise ValueError(
                f"positions must be strictly increasing (sorted, unique): {kind} "
                f"values {int(arr[i])}, {int(arr[i + 1])} at indices {i}, {i + 1}"
            )
    return arr


def _as_bytes(data) -> np.ndarray:
    """Payload (torch uint8 tensor, numpy array, bytes) as a 1-D uint8 array."""
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8:
            raise ValueError(f"payload must be a uint8 tensor, got {data.dtype}")
        return data.detach().to("cpu").reshape(-1).numpy()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return np.frombuffer(data, dtype=np.uint8)
    arr = np.asarray(data)
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint8)
    if arr.dtype != np.uint8:
        raise ValueError(f"payload must be uint8, got {arr.dtype}")
    return arr.reshape(-1)


def _values(pos: np.ndarray) -> np.ndarray:
    """Coded values v_i = d_i - 1 = pos_i - pos_{i-1} - 1 (pos_{-1} = -1)."""
    v = np.empty_like(pos)
    v[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=v[1:])
    v[1:] -= 1
    return v


# --------------------------------------------------------------------------- #
# Encoder
# --------------------------------------------------------------------------- #
def encoded_bits(positions: ArrayLike, b: int) -> int:
    """Exact length in bits of ``encode(positions, b)`` (before byte padding).

    ``sum_i ((d_i - 1) >> b) + count * (1 + b)``; no stream is built.
    """
    b = _check_b(b)
    pos = _as_positions(positions)
    if pos.size == 0:
        return 0
    q = _values(pos) >> b
    return int(q.sum(dtype=np.int64)) + pos.size * (1 + b)


def encode(positions: ArrayLike, b: int, *, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> torch.Tensor:
    """Golomb-Rice encode sorted unique non-negative ``positions``.

    Returns a CPU ``torch.uint8`` tensor of ``ceil(encoded_bits / 8)`` bytes in
    the wire format described in the module docstring (unary quotient as zeros
    then a one, ``b`` remainder bits MSB first, bits packed MSB first, last
    byte zero-padded).  Empty ``positions`` give an empty tensor.

    Raises ``ValueError`` for unsorted / duplicate / negative / non-integer
    positions, a bad ``b``, or a payload above ``max_payload_bytes`` (a huge
    gap with a too small ``b``).
    """
    return _encode_checked(_as_positions(positions), _check_b(b), max_payload_bytes)


def _coder():
    """The native coder (``core/_native/golomb_kernels.cpp``: code by code, 13-43x numpy's decode
    and 5-8x its encode), or None where the module is not built or REDSYNC_NO_NATIVE=1 is set. numpy is the
    reference and codes everything the native coder does not: b above ``NATIVE_MAX_B``, and
    every payload the native coder refuses, so that the reference's error names the problem."""
    from .select.native import load
    return load()


#: The largest b the native coder takes (a code's tail then fits one 64-bit window).
NATIVE_MAX_B = 56


def _encode_checked(pos: np.ndarray, b: int, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> torch.Tensor:
    coder = _coder() if pos.size and b <= NATIVE_MAX_B else None
    if coder is not None:
        payload, ok = coder.golomb_encode(torch.from_numpy(pos), b, max_payload_bytes)
        if ok:
            return payload
    return _encode_reference(pos, b, max_payload_bytes)


def _encode_reference(pos: np.ndarray, b: int, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> torch.Tensor:
    """numpy's encode of checked positions (the module docstring's "Implementation")."""
    n = pos.size
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)

    v = _values(pos)
    q = v >> b
    # The terminator (the unary "1") of code i sits at bit start_i + q_i with
    # start_i = sum_{j<i} (q_j + 1 + b), i.e. term_i = cumsum(q)_i + i * (1 + b).
    term = np.cumsum(q)
    term += np.arange(n, dtype=np.int64) * (1 + b)
    total_bits = int(term[-1]) + 1 + b
    nbytes = (total_bits + 7) >> 3
    if nbytes > max_payload_bytes:
        raise ValueError(
            f"Golomb payload would be {nbytes} bytes (> max_payload_bytes={max_payload_bytes}); "
            f"b={b} is far too small for these gaps, use a larger b (e.g. optimal_b(count/numel))"
        )
    # Everything before a terminator is a unary zero, so only the "tail" of
    # each code -- the (b+1)-bit word 1 r_{b-1} .. r_0 starting at term_i --
    # has to be written into a zero buffer.
    if b <= 56:
        out = _write_tails_bytewise(term, v, b, nbytes)
    else:
        out = _write_tails_bitwise(term, v, b, nbytes)
    return torch.from_numpy(out)


def _write_tails_bytewise(term: np.ndarray, v: np.ndarray, b: int, nbytes: int) -> np.ndarray:
    """OR each code's (b+1)-bit tail into the output, one byte column at a time.

    The tail starting at bit ``term_i`` lies inside the ``span`` bytes from byte
    ``term_i >> 3`` (span <= 8 for b <= 56): it is shifted into a big-endian
    uint64 window, split into ``span`` byte columns, and column ``j`` is
    OR-reduced over the codes that share a start byte (``term`` is sorted, so
    they are contiguous) before being OR-ed into the output.
    """
    span = (b + 15) // 8  # ceil((7 + b + 1) / 8): worst bit offset 7
    tail = (v & np.int64((1 << b) - 1)).astype(np.uint64) | np.uint64(1 << b)
    shift = (8 * span - (b + 1)) - (term & 7)
    window = tail << shift.astype(np.uint64)
    start_byte = term >> 3
    grp = np.flatnonzero(_first_of_runs(start_byte))
    first = start_byte[grp]
    out = np.zeros(nbytes + span, dtype=np.uint8)
    for j in range(span):  # <= 8 byte columns, each fully vectorised
        col = (window >> np.uint64(8 * (span - 1 - j))).astype(np.uint8)  # keeps low 8 bits
        out[first + j] |= np.bitwise_or.reduceat(col, grp)
    return out[:nbytes]


def _write_tails_bitwise(term: np.ndarray, v: np.ndarray, b: int, nbytes: int) -> np.ndarray:
    """Fallback for b > 56: compute the position of every one bit explicitly."""
    n = term.size
    shifts = np.arange(b - 1, -1, -1, dtype=np.int64)  # MSB first
    is_one = np.empty((n, b + 1), dtype=bool)
    is_one[:, 0] = True  # the terminator
    is_one[:, 1:] = (v[:, None] >> shifts) & 1
    ones = (term[:, None] + np.arange(b + 1, dtype=np.int64))[is_one]  # sorted
    byte_idx = ones >> 3
    masks = np.right_shift(np.uint8(0x80), (ones & 7).astype(np.uint8))
    grp = np.flatnonzero(_first_of_runs(byte_idx))
    out = np.zeros(nbytes, dtype=np.uint8)
    out[byte_idx[grp]] = np.bitwise_or.reduceat(masks, grp)
    return out


# --------------------------------------------------------------------------- #
# Decoder
# --------------------------------------------------------------------------- #
def _one_bits_and_next(buf: np.ndarray, b: int) -> Tuple[np.ndarray, np.ndarray]:
    """Bit positions of all one bits in ``buf`` and the "next terminator" map.

    ``ones`` are the sorted bit indices (MSB-first numbering) of the one bits.
    ``nxt[k]`` is the index (into ``ones``) of the first one bit at or after
    ``ones[k] + 1 + b`` -- where the code after a terminator at ``ones[k]``
    has its own terminator -- or ``len(ones)`` if there is none.  It is the
    number of one bits at positions ``<= ones[k] + b``: one gather into the
    running count of one bits.
    """
    bits = np.unpackbits(buf).view(np.bool_)  # 0/1 bytes viewed as bool (fast nonzero)
    ones = np.flatnonzero(bits)
    if b == 0:
        return ones, np.arange(1, ones.size + 1, dtype=np.int64)
    idx_dtype = np.int32 if bits.size < np.iinfo(np.int32).max else np.int64
    rank = np.cumsum(bits, dtype=idx_dtype)  # rank[t] = #ones at positions <= t
    t = ones + b
    np.minimum(t, bits.size - 1, out=t)
    return ones, rank[t]


def _first_of_runs(sorted_vals: np.ndarray) -> np.ndarray:
    """Boolean mask of the first element of each run of equal values."""
    mask = np.empty(sorted_vals.size, dtype=bool)
    if sorted_vals.size:
        mask[0] = True
        np.not_equal(sorted_vals[1:], sorted_vals[:-1], out=mask[1:])
    return mask


def _chain(g: np.ndarray, start: int, count: int) -> np.ndarray:
    """``[start, g(start), g(g(start)), ...]`` (``count`` items), vectorised.

    ``g`` maps node ``i`` in ``[0, m)`` to a node in ``(i, m]`` and is
    non-decreasing; ``m = len(g)`` is a sentinel (end of stream), which maps to
    itself.  Two ingredients, both exact: pointer doubling (``_double``) and

    * graph reduction: every chain item after the first ``2^t`` lies in the
      image of ``J``, and that image is closed under ``g``.  Decoding chains
      started at wrong bits (inside remainders) quickly merge into the true
      one (Rice codes self-synchronise), so after a few rounds the image is
      little more than the rest of the true chain.  The search restarts on the
      image; as soon as the image *is* a chain in index order it is the answer.
      If the excess over the chain stops halving (adversarial streams whose
      false chains never merge) plain doubling finishes the job, so the cost
      is O(m log count) in the worst case and ~O(m) on real data.

    Returns global node indices; items past the end of the stream equal ``m``.
    """
    m = g.size
    nodes = None  # global id of each local node (None: identity)
    out = []
    measure_next = True
    while True:
        mloc = g.size
        gext = np.empty(mloc + 1, dtype=g.dtype)
        gext[:mloc] = g
        gext[mloc] = mloc
        chain, jump, vals, first, excess_zero = _double(gext, start, count, measure_next)
        done = chain.size >= count
        if done:
            chain = chain[:count]
        out.append(chain.astype(np.int64) if nodes is None else np.append(nodes, m)[chain])
        if done:
            break
        count -= chain.size
        if jump[start] == mloc:  # the chain runs off the end
            out.append(np.full(count, m, dtype=np.int64))
            break
        # Restrict to the image of `jump` from its current item on: closed
        # under g, contains the rest of the chain, starts with it.
        keep = vals[np.flatnonzero(first)]
        if keep[-1] == mloc:
            keep = keep[:-1]
        img = np.zeros(mloc + 1, dtype=bool)
        img[keep] = True
        inv = np.cumsum(img, dtype=g.dtype)
        inv -= 1  # local index of each kept node
        inv[mloc] = keep.size  # sentinel
        g = inv[gext[keep]]
        start = 0
        nodes = keep if nodes is None else nodes[keep]
        # Shortcut: the image is exactly the chain (in index order).
        if keep.size >= count and np.array_equal(g[: count - 1], np.arange(1, count, dtype=g.dtype)):
            out.append(nodes[:count].astype(np.int64))
            break
        # (Only a truncated chain fails the shortcut when the excess was 0.)
        measure_next = not excess_zero
    return np.concatenate(out)


def _double(gext: np.ndarray, start: int, count: int, measure: bool):
    """Pointer doubling: with ``J = g^(2^t)`` the chain prefix of length ``2^(t+1)`` is the prefix of
    length ``2^t`` followed by ``J`` applied to it (``t`` rounds of gathers give ``2^t`` items).

    Doubling rounds from ``start`` until the chain has ``count`` items or (``measure``) the image
    of the jump is small enough to restart on: (chain, jump, the jump's values from ``start``,
    the first of each run of them, whether the image is exactly the rest of the chain)."""
    mloc = gext.size - 1
    chain, jump = np.array([start], dtype=gext.dtype), gext
    vals = first = None
    excess, excess_zero = None, False
    while True:
        # Doubling round: chain = first 2^(t+1) items, jump = g^(2^(t+1)).
        chain = np.concatenate((chain, jump[chain]))
        if chain.size >= count:
            return chain, jump, vals, first, excess_zero
        jump = jump[jump]
        if not measure:
            continue
        # jump is non-decreasing, so its image from `start` on is its
        # distinct values there, and the rest of the chain is part of it.
        vals = jump[start:mloc]
        first = _first_of_runs(vals)
        distinct = int(np.count_nonzero(first)) - int(vals[-1] == mloc)
        new_excess = distinct - (count - chain.size)
        if new_excess < 0:  # fewer candidates than codes still needed:
            measure = False  # truncated stream, the chain will hit the sentinel
            continue
        excess_zero = new_excess == 0
        if excess_zero or 2 * distinct <= mloc - start:
            return chain, jump, vals, first, excess_zero
        if excess is not None and new_excess > 0.75 * excess:
            measure = False  # false chains not merging: plain doubling
        excess = new_excess


def decode(data, count: int, b: int) -> torch.Tensor:
    """Inverse of :func:`encode`: the first ``count`` positions in ``data``.

    ``data`` is the payload (uint8 tensor / array / bytes); ``count`` and ``b``
    come from the message header.  Returns a CPU ``torch.int64`` tensor.
    Raises ``ValueError`` if the payload holds fewer than ``count`` codes.
    """
    b = _check_b(b)
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")
    count = int(count)
    buf = _as_bytes(data)
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    coder = _coder() if b <= NATIVE_MAX_B else None
    if coder is not None:
        payload = buf if buf.flags.writeable and buf.flags.c_contiguous else buf.copy()   # torch shares it
        positions, ok = coder.golomb_decode(torch.from_numpy(payload), count, b)
        if ok:
            return positions
    return _decode_reference(buf, count, b)


def _decode_reference(buf: np.ndarray, count: int, b: int) -> torch.Tensor:
    """numpy's decode of a payload (the module docstring's "Implementation"); raises on a corrupt one."""
    total_bits = buf.size * 8

    ones, nxt = _one_bits_and_next(buf, b)
    if ones.size < count:
        raise ValueError(
            f"corrupt or truncated Golomb payload: at most {ones.size} codes in "
            f"{buf.size} bytes, expected {count}"
        )
    if b == 0:
        term = ones[:count]  # no remainder bits: every one bit is a terminator
    else:
        # The first one bit is the first terminator; the terminators are the
        # chain 0, g(0), g(g(0)), ... of the "next terminator" map.
        idx = _chain(nxt, 0, count)
        if idx[-1] == ones.size:
            found = int(np.count_nonzero(idx != ones.size))
            raise ValueError(f"corrupt or truncated Golomb payload: found {found} codes, expected {count}")
        term = ones[idx]
    if int(term[-1]) + b >= total_bits:
        raise ValueError("corrupt or truncated Golomb payload: last remainder runs past the end")

    # Code i starts right after the remainder of code i-1: q_i = term_i - start_i.
    q = np.empty(count, dtype=np.int64)
    q[0] = term[0]
    np.subtract(term[1:], term[:-1], out=q[1:])
    q[1:] -= 1 + b
    # Guard against int64 overflow (only a corrupt stream or absurd b can get there).
    big = (float(q.sum()) + count) * 2.0**b >= 2.0**62
    if big and int(q.max()) > (np.iinfo(np.int64).max >> b):
        raise ValueError("corrupt Golomb payload: decoded gap overflows int64")
    v = q << b
    if b:
        v |= _read_fields(buf, term + 1, b)
    # positions = cumsum(v + 1) - 1
    v += 1
    pos = np.cumsum(v)
    pos -= 1
    if big and (pos[0] < 0 or np.any(pos[1:] <= pos[:-1])):
        raise ValueError("corrupt Golomb payload: decoded positions overflow int64")
    return torch.from_numpy(pos)


def _read_fields(buf: np.ndarray, first_bit: np.ndarray, b: int) -> np.ndarray:
    """The ``b``-bit big-endian fields starting at bits ``first_bit``.

    Bits past the end of ``buf`` read as 0.  For ``b <= 57`` each field is cut
    out of a uint64 window assembled from the ``ceil((7 + b) / 8)`` bytes that
    cover it; larger ``b`` gathers the bits one column at a time.
    """
    if b <= 57:
        span = (b + 14) // 8  # ceil((7 + b) / 8) bytes cover the field
        padded = np.zeros(buf.size + span, dtype=np.uint64)
        padded[: buf.size] = buf
        start_byte = first_bit >> 3
        np.minimum(start_byte, buf.size, out=start_byte)
        window = padded[start_byte]
        for j in range(1, span):  # <= 8 byte columns
            window <<= np.uint64(8)
            window |= padded[start_byte + j]
        shift = (8 * span - b) - (first_bit & 7)
        window >>= shift.astype(np.uint64)
        window &= np.uint64((1 << b) - 1)
        return window.view(np.int64)
    bitpos = first_bit[:, None] + np.arange(b, dtype=np.int64)  # (count, b)
    ok = bitpos < 8 * buf.size
    np.minimum(bitpos, 8 * buf.size - 1, out=bitpos)
    bits = ((buf[bitpos >> 3] >> (7 - (bitpos & 7)).astype(np.uint8)) & 1) * ok
    r = np.zeros(first_bit.size, dtype=np.int64)
    for j in range(b):  # <= 62 bit columns
        r = (r << 1) | bits[:, j]
    return r


# --------------------------------------------------------------------------- #
# Convenience pair for compressors
# --------------------------------------------------------------------------- #
def choose_b(count: int, numel: int, density: Optional[float] = None) -> int:
    """Rice parameter for ``count`` positions in a layer of ``numel`` elements.

    Uses ``density`` if given, else ``p = count / numel``; ``p >= 1`` (every
    element selected) gives ``b = 0`` (1 bit per position), ``p == 0`` gives 0.
    """
    if density is None:
        if numel <= 0:
            return 0
        p = count / numel
    else:
        p = float(density)
        if not (0.0 <= p <= 1.0) or math.isnan(p):
            raise ValueError(f"density must be in [0, 1], got {density!r}")
    if p <= 0.0 or p >= 1.0:
        return 0
    return optimal_b(p)


def encode_positions(
    positions: ArrayLike, numel: int, density: Optional[float] = None
) -> Tuple[torch.Tensor, int]:
    """Encode the sorted positions of a layer with ``numel`` elements.

    ``b`` is ``optimal_b(p)`` with ``p = density`` if given, else
    ``count / numel``.  Returns ``(payload_uint8, b)``; send ``count`` and
    ``b`` in the header and decode with :func:`decode_positions`.
    Raises ``ValueError`` if a position is ``>= numel``.
    """
    if isinstance(numel, bool) or not isinstance(numel, (int, np.integer)) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    pos = _as_positions(positions)
    if pos.size and int(pos[-1]) >= numel:
        raise ValueError(f"position {int(pos[-1])} out of range for a layer of numel={numel}")
    b = choose_b(pos.size, int(numel), density)
    return _encode_checked(pos, b), b


def decode_positions(payload, count: int, b: int) -> torch.Tensor:
    """Inverse of :func:`encode_positions` (same as :func:`decode`)."""
    return decode(payload, count, b)
