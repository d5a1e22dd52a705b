"""Tests for redsync_hvd.core.golomb: Golomb-Rice position coding as SBC uses it (Sattler et al., IJCNN 2019)."""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redsync_hvd.core import golomb
from redsync_hvd.core.golomb import (
    decode,
    decode_positions,
    encode,
    encode_positions,
    encoded_bits,
    expected_bits,
    optimal_b,
)


# --------------------------------------------------------------------------- #
# Reference: a deliberately naive per-bit encoder of the documented format.
# --------------------------------------------------------------------------- #
def reference_bits(positions, b):
    """'0' * q + '1' + b remainder bits (MSB first) per gap, as a string."""
    out, prev = [], -1
    for p in positions:
        v = int(p) - prev - 1
        prev = int(p)
        out.append("0" * (v >> b) + "1" + (format(v & ((1 << b) - 1), f"0{b}b") if b else ""))
    return "".join(out)


def reference_bytes(positions, b):
    s = reference_bits(positions, b)
    s += "0" * (-len(s) % 8)
    return bytes(int(s[i : i + 8], 2) for i in range(0, len(s), 8))


def roundtrip(pos, b):
    pos = np.asarray(pos, dtype=np.int64)
    payload = encode(pos, b)
    assert payload.dtype == torch.uint8 and payload.device.type == "cpu" and payload.dim() == 1
    nbits = encoded_bits(pos, b)
    assert payload.numel() == (nbits + 7) // 8
    out = decode(payload, pos.size, b)
    assert out.dtype == torch.int64
    np.testing.assert_array_equal(out.numpy(), pos)
    return payload


def bernoulli_positions(n, p, seed):
    """Positions of an i.i.d. Bernoulli(p) mask over n elements (geometric gaps)."""
    rng = np.random.default_rng(seed)
    k = int(n * p + 10 * math.sqrt(n * p) + 10)
    pos = np.cumsum(rng.geometric(p, size=k)) - 1
    return pos[pos < n]


# --------------------------------------------------------------------------- #
# Parameter choice and cost model
# --------------------------------------------------------------------------- #
def test_optimal_b_reference_values():
    assert optimal_b(0.01) == 6
    assert optimal_b(0.001) == 9
    assert optimal_b(0.9) == 0  # clamped (formula gives < 0)
    assert optimal_b(1e-12) > optimal_b(1e-6) > optimal_b(0.001)


def test_expected_bits_reference_values():
    assert expected_bits(0.01) == pytest.approx(8.11, abs=0.005)
    assert expected_bits(0.001) == pytest.approx(11.50, abs=0.01)
    assert expected_bits(0.01, 6) == expected_bits(0.01)
    # b* minimises the expected cost over b (up to the formula's rounding).
    for p in (0.3, 0.05, 0.01, 0.001, 1e-4):
        costs = [expected_bits(p, b) for b in range(0, 24)]
        assert expected_bits(p) <= min(costs) + 0.05


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_optimal_b_rejects_bad_density(p):
    with pytest.raises(ValueError):
        optimal_b(p)


# --------------------------------------------------------------------------- #
# Exact format and round trip
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("b", [0, 1, 3, 6, 9])
def test_matches_reference_bitstream(b):
    pos = [0, 1, 2, 5, 17, 18, 100, 1000, 1001, 5000]
    assert bytes(encode(pos, b).numpy()) == reference_bytes(pos, b)
    assert encoded_bits(pos, b) == len(reference_bits(pos, b))


def test_documented_example():
    # b=2.  pos 0: v=0, q=0, r=00 -> "1" "00";  pos 5: v=5-0-1=4, q=1, r=00 -> "01" "00"
    # stream "100" "0100" = 7 bits, zero-padded to one byte 1000_1000.
    assert encode([0, 5], 2).tolist() == [0b10001000]
    assert decode(torch.tensor([0b10001000], dtype=torch.uint8), 2, 2).tolist() == [0, 5]


@st.composite
def positions_and_b(draw):
    b = draw(st.integers(0, 16))
    gaps = draw(
        st.lists(
            st.one_of(st.integers(1, 4), st.integers(1, 1 << 12), st.integers(1, 1 << 20)),
            min_size=0,
            max_size=300,
        )
    )
    # Keep payloads small: q = gap >> b is the unary length.
    gaps = [g if (g >> b) < 4096 else (g & ((1 << (b + 12)) - 1)) + 1 for g in gaps]
    pos = np.cumsum(np.asarray(gaps, dtype=np.int64)) - 1
    return pos, b


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(positions_and_b())
def test_roundtrip_property(case):
    pos, b = case
    payload = roundtrip(pos, b)
    if pos.size <= 60:
        assert bytes(payload.numpy()) == reference_bytes(pos, b)


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(0, 1 << 40), max_size=50), st.integers(0, 62))
def test_roundtrip_sparse_wide_range(values, b):
    pos = np.array(sorted(values), dtype=np.int64)
    if pos.size and encoded_bits(pos, b) > 1 << 20:
        b = 40  # keep the unary part small
    roundtrip(pos, b)


def test_empty():
    for b in (0, 6, 62):
        payload = encode([], b)
        assert payload.dtype == torch.uint8 and payload.numel() == 0
        assert decode(payload, 0, b).numel() == 0
        assert encoded_bits([], b) == 0
    assert encode(torch.empty(0, dtype=torch.int64), 3).numel() == 0
    p, b = encode_positions([], 1000)
    assert p.numel() == 0 and decode_positions(p, 0, b).numel() == 0


@pytest.mark.parametrize("b", [0, 1, 6, 20, 62])
def test_single_position_zero(b):
    payload = roundtrip([0], b)
    assert payload.numel() == (1 + b + 7) // 8


def test_single_huge_index():
    pos = [2**40]
    roundtrip(pos, 40)
    roundtrip(pos, 38)  # q = 4
    roundtrip(pos, 62)
    roundtrip(pos, 24)  # q = 65536 unary zeros
    payload, b = encode_positions(pos, 2**41)
    np.testing.assert_array_equal(decode_positions(payload, 1, b).numpy(), pos)
    with pytest.raises(ValueError, match="larger b"):
        encode(pos, 0)  # would need 2**40 bits


@pytest.mark.parametrize("b", [0, 1, 2, 5, 9])
def test_adjacent_positions(b):
    roundtrip(np.arange(1000), b)
    roundtrip(np.arange(10**6, 10**6 + 1000), b)


def test_all_positions_of_small_layer():
    n = 4096
    payload, b = encode_positions(np.arange(n), n)
    assert b == 0 and payload.numel() == n // 8  # one bit per position
    assert bool((payload == 255).all())
    np.testing.assert_array_equal(decode_positions(payload, n, b).numpy(), np.arange(n))


@pytest.mark.parametrize("b,step", [(1, 2), (3, 8), (4, 16), (2, 3)])
def test_streams_whose_false_parses_never_resynchronise(b, step):
    # Every gap has q = 0 and an all-ones remainder (or a fixed pattern), so
    # parses started inside a remainder never merge with the true one: this
    # exercises the decoder's plain pointer-doubling fallback.
    pos = np.arange(step - 1, 200_000, step)
    roundtrip(pos, b)


def test_accepts_numpy_torch_and_lists():
    pos = [3, 9, 10, 400]
    ref = encode(np.array(pos, dtype=np.int64), 4)
    for x in (pos, np.array(pos, dtype=np.int32), np.array(pos, dtype=np.uint16), torch.tensor(pos)):
        assert torch.equal(encode(x, 4), ref)
    out = decode(bytes(ref.numpy()), 4, 4)
    assert out.tolist() == pos
    assert decode(ref.numpy(), 4, 4).tolist() == pos


def test_decode_prefix_of_stream():
    pos = np.array([1, 5, 6, 90, 91, 1000])
    payload = encode(pos, 3)
    assert decode(payload, 3, 3).tolist() == [1, 5, 6]


@pytest.mark.parametrize("b", range(0, 15))
def test_roundtrip_mismatched_b(b):
    # b far from b* = 5 for p = 0.02: long unary runs (small b) or many
    # remainder bits (large b) -- both stress the terminator search.
    roundtrip(bernoulli_positions(400_000, 0.02, seed=10 + b), b)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(1, 20))
def test_corrupted_payload_never_crashes(seed, b, nflips):
    rng = np.random.default_rng(seed)
    pos = bernoulli_positions(20_000, 0.02, seed=seed)
    data = encode(pos, b).numpy().copy()
    flips = rng.integers(0, 8 * data.size, nflips)
    np.bitwise_xor.at(data, flips >> 3, (0x80 >> (flips & 7)).astype(np.uint8))
    try:
        out = decode(torch.from_numpy(data), pos.size, b)
    except ValueError:
        return
    assert out.dtype == torch.int64 and out.numel() == pos.size
    o = out.numpy()
    assert o[0] >= 0 and np.all(np.diff(o) > 0)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3000), st.integers(1, 9), st.data())
def test_chain_matches_naive_walk(seed, m, maxjump, data):
    """The decoder's terminator search (doubling + graph reduction) vs a loop."""
    rng = np.random.default_rng(seed)
    g = np.arange(1, m + 1) + rng.integers(0, maxjump, m)
    g = np.minimum(np.maximum.accumulate(g), m).astype(np.int32)
    count = data.draw(st.integers(1, m + 5))
    expect, x = [], 0
    for _ in range(count):
        expect.append(x)
        x = m if x == m else int(g[x])
    np.testing.assert_array_equal(golomb._chain(g, 0, count), expect)


# --------------------------------------------------------------------------- #
# Invalid inputs
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "pos,match",
    [
        ([3, 2], "unsorted"),
        ([1, 1], "duplicate"),
        ([0, 5, 5, 7], "duplicate"),
        ([-1, 3], "non-negative"),
        ([[1, 2]], "1-D"),
        ([1.0, 2.0], "integer"),
    ],
)
def test_encode_rejects_invalid_positions(pos, match):
    with pytest.raises(ValueError, match=match):
        encode(np.array(pos), 3)


def test_encode_rejects_invalid_torch_positions():
    with pytest.raises(ValueError, match="integer"):
        encode(torch.tensor([1.0, 2.0]), 3)
    with pytest.raises(ValueError, match="unsorted"):
        encode(torch.tensor([5, 4]), 3)


@pytest.mark.parametrize("b", [-1, 63, 2.0, None, True])
def test_rejects_bad_b(b):
    with pytest.raises(ValueError):
        encode([1, 2], b)
    with pytest.raises(ValueError):
        decode(torch.zeros(4, dtype=torch.uint8), 1, b)


def test_encode_positions_rejects_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        encode_positions([5, 10], 10)


def test_decode_rejects_truncated_or_bad_payload():
    pos = np.array(bernoulli_positions(100_000, 0.01, seed=1))
    payload = encode(pos, 6)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        decode(payload[: payload.numel() // 2], pos.size, 6)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        decode(payload, pos.size + 1, 6)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        decode(torch.zeros(16, dtype=torch.uint8), 1, 6)
    with pytest.raises(ValueError):
        decode(payload, -1, 6)
    with pytest.raises(ValueError, match="uint8"):
        decode(torch.zeros(4, dtype=torch.int32), 1, 6)
    # Garbage decodes to *something* or raises ValueError; it never hangs.
    rng = np.random.default_rng(0)
    junk = torch.from_numpy(rng.integers(0, 256, 4096, dtype=np.uint8))
    try:
        decode(junk, 1000, 5)
    except ValueError:
        pass


# --------------------------------------------------------------------------- #
# Real layers: size, speed-scale inputs and measured bits
# --------------------------------------------------------------------------- #
def test_huge_layer_roundtrip():
    n, p = 50_000_000, 0.001
    pos = bernoulli_positions(n, p, seed=2)
    payload, b = encode_positions(torch.from_numpy(pos), n)
    assert b == optimal_b(pos.size / n)
    out = decode_positions(payload, pos.size, b)
    np.testing.assert_array_equal(out.numpy(), pos)
    assert int(out.max()) < n


@pytest.mark.parametrize("p", [0.01, 0.001])
def test_measured_bits_match_formula(p):
    """Bits counted from the byte stream (padding included) vs the formula."""
    n = 10_000_000
    k = int(n * p)
    rng = np.random.default_rng(3)
    pos = np.sort(rng.choice(n, size=k, replace=False))
    payload, b = encode_positions(pos, n)
    assert b == optimal_b(p)
    measured = 8 * payload.numel() / k
    assert measured == pytest.approx(expected_bits(p), rel=0.01)
    exact = encoded_bits(pos, b) / k
    assert exact <= measured < exact + 8 / k + 1e-12
    # ~4x (p=0.01) / ~2.8x (p=0.001) fewer bits than int32 positions.
    assert measured < 32 / 2.5
    np.testing.assert_array_equal(decode_positions(payload, k, b).numpy(), pos)


def test_density_argument_sets_b():
    pos = bernoulli_positions(1_000_000, 0.01, seed=4)
    payload, b = encode_positions(pos, 1_000_000, density=0.001)
    assert b == 9
    np.testing.assert_array_equal(decode_positions(payload, pos.size, b).numpy(), pos)
    with pytest.raises(ValueError):
        encode_positions(pos, 1_000_000, density=2.0)


# --------------------------------------------------------------------------- #
# The native coder (core/_native/golomb_kernels.cpp) against numpy's reference
# --------------------------------------------------------------------------- #
needs_native = pytest.mark.skipif(golomb._coder() is None, reason="the native module is not built")


def _both_decode(payload, count, b):
    """(native-or-fallback result, reference result); each a tensor or the ValueError's type."""
    out = []
    reference = golomb._decode_reference
    for fn in (lambda: decode(payload, count, b), lambda: reference(golomb._as_bytes(payload), count, b)):
        try:
            out.append(fn())
        except ValueError:
            out.append(ValueError)
    return out


@needs_native
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_native_coder_writes_and_reads_the_references_bytes(data):
    """Byte for byte the same payload as numpy's encoder, the same positions back, at every b the
    native coder takes (including b = 0, gaps far past 2**b and b = NATIVE_MAX_B)."""
    b = data.draw(st.one_of(st.integers(0, 12), st.just(golomb.NATIVE_MAX_B)), label="b")
    gaps = data.draw(st.lists(st.one_of(st.integers(1, 40), st.integers(1, 1 << 20)), min_size=1, max_size=300))
    pos = np.cumsum(np.asarray(gaps, dtype=np.int64)) - 1
    native = encode(pos, b)
    reference = golomb._encode_reference(pos, b)
    assert native.dtype == torch.uint8 and bytes(native.numpy()) == bytes(reference.numpy()) == reference_bytes(pos, b)
    got, want = _both_decode(native, pos.size, b)
    assert torch.equal(got, want) and torch.equal(got, torch.from_numpy(pos))


@needs_native
@pytest.mark.parametrize("b", [0, 1, 3, 9])
@pytest.mark.parametrize("seed", range(6))
def test_native_coder_fails_where_the_reference_fails_on_a_corrupt_payload(seed, b):
    """Flipped bits, a cut payload, a count past the codes: the native decode returns what the
    reference returns, or the reference's ValueError (never other positions, never a crash)."""
    rng = np.random.default_rng(seed)
    pos = np.sort(rng.choice(50_000, size=400, replace=False)).astype(np.int64)
    payload = encode(pos, b).numpy().copy()
    flipped = payload.copy()
    flipped[rng.integers(0, payload.size, size=3)] ^= np.uint8(1 << int(rng.integers(0, 8)))
    for data, count in ((flipped, pos.size), (payload[: payload.size // 2], pos.size), (payload, pos.size + 1),
                        (np.zeros(8, dtype=np.uint8), 3)):
        got, want = _both_decode(data, count, b)
        assert (got is want is ValueError) or (isinstance(got, torch.Tensor) and torch.equal(got, want)), (data, count)


@needs_native
def test_native_encode_refuses_a_payload_past_the_limit_as_the_reference_does():
    with pytest.raises(ValueError, match="max_payload_bytes"):
        encode([0, 10_000_000], 0, max_payload_bytes=1000)
