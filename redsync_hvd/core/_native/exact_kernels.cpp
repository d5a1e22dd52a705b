// Exactly k among one layer's candidates, as the radix reference selects them
// (core/select/radix_ref.py:_ref_select): the last step of core/select/native_radix.py.
//
// The candidates are a threshold set, in position order, that holds every element at or above
// the layer's k-th largest key, all finite; so the reference's answer comes from them alone:
//   key_s(x) = float32 bits of |x| (side -1), or of x on its side s (0: x > 0, 1: x < 0) and 0
//              for the other sign, as the reference's sided rows count it
//   T_s      = the k-th largest key_s                                   (nth_element, a copy)
//   need_s   = k - #{key_s > T_s}
//   mag_s    = (sum of the keys above T_s as floats, in double, in position order,
//               + need_s * T_s as a float) / k        (the reference's float64 index_add_)
//   take     = key_s > T_s, then the first need_s keys == T_s, ascending
// The reference makes these with a dozen torch ops per level over the candidates of every
// layer; here a pass to find T, one to count and sum, one to take.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <vector>

namespace {

inline uint32_t key_of(float v, int64_t side) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (side < 0) return magnitude;
  return static_cast<int64_t>(bits >> 31) == side ? magnitude : 0u;
}

inline double as_double(uint32_t key) {
  float f;
  std::memcpy(&f, &key, sizeof f);
  return static_cast<double>(f);
}

const float* checked(const at::Tensor& x, int64_t k, int64_t side) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.scalar_type() == at::kFloat && x.dim() == 1,
              "redsync exact-k: a contiguous 1-D CPU float32 tensor of candidates");
  TORCH_CHECK(k >= 1 && k <= x.numel(), "redsync exact-k: need 1 <= k <= candidates, got k=", k, " of ", x.numel());
  TORCH_CHECK(side >= -1 && side <= 1, "redsync exact-k: side -1 (|x|), 0 (x > 0) or 1 (x < 0), got ", side);
  return x.data_ptr<float>();
}

}  // namespace

// (T, need, mag) of side `side`'s keys among the candidates x.
std::tuple<int64_t, int64_t, double> kth_side(const at::Tensor& x, int64_t k, int64_t side) {
  const float* p = checked(x, k, side);
  const int64_t n = x.numel();
  std::vector<uint32_t> keys(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = key_of(p[i], side);
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t t = keys[k - 1];
  int64_t above = 0;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {   // position order: the reference's sum, bit for bit
    const uint32_t key = key_of(p[i], side);
    if (key > t) {
      ++above;
      sum += as_double(key);
    }
  }
  const int64_t need = k - above;
  const double at_t = need > 0 ? static_cast<double>(need) * as_double(t) : 0.0;
  return {static_cast<int64_t>(t), need, (sum + at_t) / static_cast<double>(k)};
}

// Ascending candidate positions of side `side`'s k: key > t, then the first `need` keys == t.
at::Tensor take_side(const at::Tensor& x, int64_t k, int64_t side, int64_t t, int64_t need) {
  const float* p = checked(x, k, side);
  auto out = at::empty({k}, at::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  int64_t got = 0;
  const uint32_t tt = static_cast<uint32_t>(t);
  for (int64_t i = 0, n = x.numel(); i < n && got < k; ++i) {
    const uint32_t key = key_of(p[i], side);
    if (key > tt || (key == tt && need > 0)) {
      if (key == tt) --need;
      o[got++] = i;
    }
  }
  TORCH_CHECK(got == k, "redsync exact-k: took ", got, " of k=", k, " (t and need are not this side's)");
  return out;
}

void register_exact(pybind11::module& m) {
  m.def("kth_side", &kth_side, "(k-th largest key, how many of it are taken, mean magnitude of the k) of one side",
        pybind11::arg("x"), pybind11::arg("k"), pybind11::arg("side"));
  m.def("take_side", &take_side, "ascending positions of one side's k: key > t, then the first need keys == t",
        pybind11::arg("x"), pybind11::arg("k"), pybind11::arg("side"), pybind11::arg("t"), pybind11::arg("need"));
}
