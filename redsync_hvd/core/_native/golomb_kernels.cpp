// Golomb-Rice coding of sorted positions, one code after the other: core/golomb.py's wire format
// (its numpy encode and decode are the reference; tests/test_golomb.py checks both ways).
//
//   v_i = pos_i - pos_{i-1} - 1 (pos_{-1} = -1),  q_i = v_i >> b
//   code i = q_i zero bits, a one bit, then the low b bits of v_i, most significant first;
//   codes back to back, bits packed most significant first, the last byte zero-padded.
//
// numpy has to find which one bits end a unary run without a loop (pointer doubling over every
// one bit); read in order, the next terminator is one count of leading zeros away. Both
// functions return an ok flag instead of raising: where it is false the caller runs the
// reference, whose error names the problem.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>

namespace {

// The 64 bits from byte `at` on, big-endian, zeros past the end.
inline uint64_t window(const uint8_t* buf, int64_t nbytes, int64_t at) {
  uint64_t w = 0;
  if (at + 8 <= nbytes) {
    std::memcpy(&w, buf + at, 8);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    w = __builtin_bswap64(w);      // the payload is big-endian
#endif
    return w;
  }
  for (int j = 0; j < 8; ++j) w = (w << 8) | (at + j < nbytes ? buf[at + j] : 0);
  return w;
}

// `count` positions from `data` (uint8) at Rice parameter b <= 56: (positions int64, ok).
std::tuple<at::Tensor, bool> golomb_decode(const at::Tensor& data, int64_t count, int64_t b) {
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.device().is_cpu(),
              "golomb_decode: a contiguous CPU uint8 payload");
  TORCH_CHECK(b >= 0 && b <= 56 && count >= 0, "golomb_decode: b in [0, 56], count >= 0");
  at::Tensor out = at::empty({count}, data.options().dtype(at::kLong));
  const uint8_t* buf = data.data_ptr<uint8_t>();
  const int64_t nbytes = data.numel(), total = 8 * nbytes;
  const uint64_t low = (uint64_t(1) << b) - 1;
  const int64_t qmax = std::numeric_limits<int64_t>::max() >> b;
  int64_t* pos = out.data_ptr<int64_t>();
  int64_t bit = 0, prev = -1;
  for (int64_t i = 0; i < count; ++i) {
    int64_t term = bit;                       // the terminator: the first one bit from `bit` on
    for (;;) {
      if (term >= total) return {out, false};   // fewer than count codes
      const int shift = int(term & 7);
      const uint64_t w = window(buf, nbytes, term >> 3) << shift;
      if (w) { term += __builtin_clzll(w); break; }
      term += 64 - shift;
    }
    if (term >= total || term + b >= total) return {out, false};   // the remainder runs past the end
    const int64_t q = term - bit;
    if (q > qmax) return {out, false};        // the gap overflows int64
    const int64_t first = term + 1;           // the remainder's first bit: at most 7 + 56 bits from its byte
    const uint64_t r = b ? (window(buf, nbytes, first >> 3) << (first & 7)) >> (64 - b) : 0;
    const int64_t v = (q << b) | int64_t(r & low);
    if (v > std::numeric_limits<int64_t>::max() - 1 - prev) return {out, false};
    prev = pos[i] = prev + v + 1;
    bit = first + b;
  }
  return {out, true};
}

// Sorted, unique, non-negative positions (int64; the caller checked) at b <= 56: (payload uint8,
// ok); not ok where the payload would pass max_bytes.
std::tuple<at::Tensor, bool> golomb_encode(const at::Tensor& positions, int64_t b, int64_t max_bytes) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.device().is_cpu(),
              "golomb_encode: contiguous CPU int64 positions");
  TORCH_CHECK(b >= 0 && b <= 56, "golomb_encode: b in [0, 56]");
  const int64_t n = positions.numel();
  const int64_t* pos = positions.data_ptr<int64_t>();
  int64_t bits = 0, prev = -1;
  for (int64_t i = 0; i < n; ++i) {           // pass 1: the payload's length
    bits += ((pos[i] - prev - 1) >> b) + 1 + b;
    prev = pos[i];
  }
  const int64_t nbytes = (bits + 7) >> 3;
  if (nbytes > max_bytes) return {at::empty({0}, positions.options().dtype(at::kByte)), false};
  at::Tensor out = at::zeros({nbytes}, positions.options().dtype(at::kByte));
  uint8_t* buf = out.data_ptr<uint8_t>();
  const uint64_t low = (uint64_t(1) << b) - 1;
  int64_t bit = 0;
  prev = -1;
  for (int64_t i = 0; i < n; ++i) {           // pass 2: zeros are already there; write each tail
    const uint64_t v = uint64_t(pos[i] - prev - 1);
    prev = pos[i];
    bit += int64_t(v >> b);                   // the unary zeros
    const int nb = int(b) + 1;                // the tail: a one, then the remainder
    uint64_t tail = (uint64_t(1) << b) | (v & low);
    const int64_t at = bit >> 3;
    const int lead = int(bit & 7);
    tail <<= 64 - nb - lead;                  // aligned on byte `at`: lead + nb <= 64
    for (int j = 0; j < 8 && at + j < nbytes; ++j) buf[at + j] |= uint8_t(tail >> (56 - 8 * j));
    bit += nb;
  }
  return {out, true};
}

}  // namespace

void register_golomb(pybind11::module& m) {
  m.def("golomb_decode", &golomb_decode, "(count positions of a Golomb-Rice payload, ok) at b <= 56",
        pybind11::arg("data"), pybind11::arg("count"), pybind11::arg("b"));
  m.def("golomb_encode", &golomb_encode, "(Golomb-Rice payload of sorted positions, ok) at b <= 56",
        pybind11::arg("positions"), pybind11::arg("b"), pybind11::arg("max_bytes"));
}
