// Fused CPU passes for magnitude-threshold selection (redsync_hvd.core.selection).
//
// Why native: every pure-torch way to ask "how many |x| > t" or "which |x| > t"
// materialises |x| (4 B/elem) and/or a boolean mask (1 B/elem) and then reads it
// again. These kernels read x once per pass and write nothing the size of x:
//   stats        : max|x|, sum|x| and a finite check           (1 pass)
//   count_multi  : #{|x| > t_j} for T thresholds at once        (1 pass, T compares/elem)
//   select_above : sorted int64 indices of |x| > t, its count,  (1 pass)
//                  optionally their |x| and the finite check
//   compensate_scan : x = r + g (or DGC's momentum step) written   (1 pass over r, g [, u])
//                  once, with stats and select_above over x on the way
// Each ranks a key of x: |x| (side 0), or for float32 one sign's magnitude, max(x, 0) (side 1)
// or max(-x, 0) (side -1), so a sign rule's selection needs no copy of x clamped to its side.
// The finite check always covers all of x.
// Threads come from at::parallel_for (OpenMP in torch builds: compile with -fopenmp,
// else it runs serially), so torch.set_num_threads applies. Hot loops use GCC vector
// extensions or `omp simd` and are compiled for AVX2 and the baseline ISA via
// target_clones; the dynamic loader picks one at load time.
// ATen + torch's pybind casters only: <torch/extension.h> would pull in the whole C++
// frontend and triple the compile time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#if defined(__x86_64__) || defined(__SSE2__)
#include <immintrin.h>
#define RS_STREAM 1
#endif
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 16;   // elements per chunk (the unit of work and of output)
// Chunks per thread at least: a thread gets >= 1M elements (~0.2 ms of streaming), so
// small layers run on one thread. A parallel region costs a wake-up and a barrier, and
// on an oversubscribed node (several ranks per host) a preempted thread stalls it for a
// whole scheduler slice: parallelism must pay for itself.
constexpr int64_t kChunksPerThread = 16;
constexpr int64_t kBlock = 4096;      // count_multi block: stays in L1 across threshold groups

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RS_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RS_CLONES
#endif

// ---- stats -------------------------------------------------------------------------
// Float partial sums per 4096-block, then double: fast, and an overflow to inf can
// only produce a false "non-finite" which the Python side re-checks exactly.
template <typename T>
static inline __attribute__((always_inline)) void stats_impl(
    const T* p, int64_t b, int64_t e, double* mx_out, double* sum_out) {
  T mx = 0;
  double sum = 0;
  for (int64_t b0 = b; b0 < e; b0 += 4096) {
    const int64_t e0 = std::min(e, b0 + 4096);
    T s = 0;
#pragma omp simd reduction(+ : s) reduction(max : mx)
    for (int64_t i = b0; i < e0; ++i) {
      const T a = std::abs(p[i]);
      s += a;
      mx = a > mx ? a : mx;
    }
    sum += static_cast<double>(s);
  }
  *mx_out = static_cast<double>(mx);
  *sum_out = sum;
}
// |o| as sign-cleared bits; adds |o| to a float sum and the bits to an integer max. The
// scalar tails of stats_f and compensate_impl share it, so both sum in one order.
static inline __attribute__((always_inline)) int32_t abs_accumulate(float o, float* sum, int32_t* max_bits) {
  int32_t a;
  std::memcpy(&a, &o, 4);
  a &= 0x7fffffff;
  float fa;
  std::memcpy(&fa, &a, 4);
  *sum += fa;
  *max_bits = a > *max_bits ? a : *max_bits;
  return a;
}

// A side's key from x's bits, as signed integers (IEEE order for keys >= 0): side 0 clears the
// sign bit (|x|); side 1 keeps x's bits where x > 0 (max(bits, 0)); side -1 flips the sign bit
// first, so -x's magnitude comes out where x < 0. Both sides give 0 for +-0 and the other sign.
template <int SIDE, typename V>
static inline __attribute__((always_inline)) V side_key(V bits) {
  using I = std::remove_reference_t<decltype(bits[0])>;
  if constexpr (SIDE == 0) {
    return bits & (V{} + std::numeric_limits<I>::max());
  } else {
    const V k = SIDE > 0 ? bits : (bits ^ (V{} + std::numeric_limits<I>::min()));
    return k > V{} ? k : V{};
  }
}
template <int SIDE, typename I>
static inline __attribute__((always_inline)) I side_key_s(I bits) {
  if constexpr (SIDE == 0) {
    return bits & std::numeric_limits<I>::max();
  } else {
    const I k = SIDE > 0 ? bits : static_cast<I>(bits ^ std::numeric_limits<I>::min());
    return k > 0 ? k : 0;
  }
}

// float32: explicit 8-lane accumulators, summed in the same order as compensate_impl's,
// so a statistics pass fused into the compensation gives the same mean to the last bit
// (and the same TBS thresholds, so the same selection) as this separate pass.
// A side's statistics (SIDE != 0) keep a separate integer max of |x| for the finite check.
template <int SIDE>
static inline __attribute__((always_inline)) void stats_side(const float* p, int64_t b, int64_t e, double* m,
                                                             double* s) {
  constexpr int W = 8;
  typedef float vF __attribute__((vector_size(32)));
  typedef int32_t vI __attribute__((vector_size(32)));
  typedef float vFu __attribute__((vector_size(32), aligned(4), may_alias));
  const vI absmask = vI{} + 0x7fffffff;
  vI vmax = vI{}, vabs = vI{};
  int32_t smax = 0, sabs = 0;
  double sum = 0;
  for (int64_t b0 = b; b0 < e; b0 += 4096) {
    const int64_t e0 = std::min(e, b0 + 4096);
    vF acc = vF{};
    float sacc = 0;
    int64_t i = b0;
    for (; i + W <= e0; i += W) {
      const vI bits = reinterpret_cast<vI>(*reinterpret_cast<const vFu*>(p + i));
      const vI a = side_key<SIDE>(bits);
      acc += reinterpret_cast<vF>(a);
      vmax = a > vmax ? a : vmax;
      if constexpr (SIDE != 0) {
        const vI ab = bits & absmask;
        vabs = ab > vabs ? ab : vabs;
      }
    }
    for (; i < e0; ++i) {
      if constexpr (SIDE == 0) {
        abs_accumulate(p[i], &sacc, &smax);
      } else {
        int32_t bits;
        std::memcpy(&bits, p + i, 4);
        const int32_t a = side_key_s<SIDE>(bits);
        float fa;
        std::memcpy(&fa, &a, 4);
        sacc += fa;
        smax = a > smax ? a : smax;
        sabs = (bits & 0x7fffffff) > sabs ? (bits & 0x7fffffff) : sabs;
      }
    }
    for (int l = 0; l < W; ++l) sacc += acc[l];
    sum += static_cast<double>(sacc);
  }
  for (int l = 0; l < W; ++l) {
    smax = vmax[l] > smax ? vmax[l] : smax;
    sabs = vabs[l] > sabs ? vabs[l] : sabs;
  }
  float mf;
  std::memcpy(&mf, &smax, 4);
  *m = smax >= 0x7f800000 ? std::numeric_limits<double>::infinity() : static_cast<double>(mf);
  // a non-finite element of the other side: an infinite sum, which the caller re-checks
  *s = SIDE != 0 && sabs >= 0x7f800000 ? std::numeric_limits<double>::infinity() : sum;
}
RS_CLONES static void stats_f(const float* p, int64_t b, int64_t e, double* m, double* s, int side) {
  if (side == 0) stats_side<0>(p, b, e, m, s);
  else if (side > 0) stats_side<1>(p, b, e, m, s);
  else stats_side<-1>(p, b, e, m, s);
}
RS_CLONES static void stats_d(const double* p, int64_t b, int64_t e, double* m, double* s) { stats_impl(p, b, e, m, s); }

// ---- count_multi ---------------------------------------------------------------------
// One load + abs per vector, then G compares against G broadcast thresholds held in
// registers (G <= 7: 7 thresholds + 7 accumulators + data fit the 16 ymm registers).
// A compare-per-pass loop instead re-loads x per threshold and is ~2x slower.
template <typename T, int G, int SIDE>
static inline __attribute__((always_inline)) void count_group(
    const T* p, int64_t b, int64_t e, const T* thr, int64_t* cnt) {
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  constexpr int W = 32 / sizeof(T);
  typedef T vT __attribute__((vector_size(32)));
  typedef I vI __attribute__((vector_size(32)));
  typedef I vIu __attribute__((vector_size(32), aligned(sizeof(T)), may_alias));
  vT tv[G];
  vI acc[G];
  for (int j = 0; j < G; ++j) {
    tv[j] = vT{} + thr[j];
    acc[j] = vI{};
  }
  int64_t i = b;
  for (; i + W <= e; i += W) {
    const vT v = (vT)side_key<SIDE>(vI(*reinterpret_cast<const vIu*>(p + i)));
    for (int j = 0; j < G; ++j) acc[j] -= (vI)(v > tv[j]);  // true lanes are -1
  }
  for (int j = 0; j < G; ++j) {
    int64_t c = 0;
    for (int l = 0; l < W; ++l) c += acc[j][l];  // a block (kBlock) cannot overflow a lane
    for (int64_t r = i; r < e; ++r) {
      I bits;
      std::memcpy(&bits, p + r, sizeof(T));
      const I kb = side_key_s<SIDE>(bits);
      T key;
      std::memcpy(&key, &kb, sizeof(T));
      c += key > thr[j] ? 1 : 0;
    }
    cnt[j] += c;
  }
}

template <typename T, int SIDE>
static inline __attribute__((always_inline)) void count_impl(
    const T* p, int64_t b, int64_t e, const T* thr, int64_t nt, int64_t* cnt) {
  for (int64_t b0 = b; b0 < e; b0 += kBlock) {  // groups after the first re-read from L1
    const int64_t e0 = std::min(e, b0 + kBlock);
    for (int64_t j = 0; j < nt; j += 7) {
      const int64_t g = std::min<int64_t>(7, nt - j);
      T t[7];  // pad with +inf: counts nothing (x is finite by the time we count)
      int64_t c[7] = {0, 0, 0, 0, 0, 0, 0};
      for (int l = 0; l < 7; ++l) t[l] = l < g ? thr[j + l] : std::numeric_limits<T>::infinity();
      if (g == 1) count_group<T, 1, SIDE>(p, b0, e0, t, c);
      else if (g <= 3) count_group<T, 3, SIDE>(p, b0, e0, t, c);
      else count_group<T, 7, SIDE>(p, b0, e0, t, c);
      for (int l = 0; l < g; ++l) cnt[j + l] += c[l];
    }
  }
}
RS_CLONES static void count_f(const float* p, int64_t b, int64_t e, const float* t, int64_t nt, int64_t* c,
                              int side) {
  if (side == 0) count_impl<float, 0>(p, b, e, t, nt, c);
  else if (side > 0) count_impl<float, 1>(p, b, e, t, nt, c);
  else count_impl<float, -1>(p, b, e, t, nt, c);
}
RS_CLONES static void count_d(const double* p, int64_t b, int64_t e, const double* t, int64_t nt, int64_t* c) { count_impl<double, 0>(p, b, e, t, nt, c); }

// ---- select_above --------------------------------------------------------------------
// Works on the bit patterns: for t >= 0, |x| > t  <=>  (bits(x) & 0x7f..f) > bits(t) as
// signed integers (IEEE order), and max of those masked bits >= bits(inf) <=> a NaN/Inf
// is present. So the finite check is one integer max per vector, not an FP reduction.
// One branch per 4 vectors: only groups holding a hit (rare) are compacted.
template <typename T, int SIDE>
static inline __attribute__((always_inline)) void select_impl(
    const T* p, int64_t b, int64_t e, T t, int64_t cap, bool check,
    std::vector<int64_t>* out, std::vector<T>* vals, int64_t* count, bool* finite) {
  using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
  constexpr int W = 32 / sizeof(T);
  typedef I vI __attribute__((vector_size(32)));
  typedef int64_t vL __attribute__((vector_size(32)));
  const I mask = std::numeric_limits<I>::max();
  const I inf_bits = sizeof(T) == 4 ? I(0x7f800000) : I(0x7ff0000000000000LL);
  if (t == 0) t = 0;  // -0.0 would compare below every +0 in the integer domain
  I tb;
  std::memcpy(&tb, &t, sizeof(T));
  // unaligned, aliasing-safe vector loads (memcpy into vector arrays made GCC split
  // them into two 16-byte stores + a 32-byte reload: a store-forwarding stall)
  typedef I vIu __attribute__((vector_size(32), aligned(sizeof(T)), may_alias));
  const vI vt = vI{} + tb, vm = vI{} + mask;
  vI vmax = vI{};
  I smax = 0;
  int64_t c = 0, w = 0, i = b;  // hits seen, hits written (w == c until the cap)
  auto scalar = [&](int64_t j) {  // branchy: tails, and groups near the cap
    I u;
    std::memcpy(&u, p + j, sizeof(T));
    smax = (u & mask) > smax ? (u & mask) : smax;
    u = side_key_s<SIDE>(u);
    if (u > tb) {
      if (w < cap) {
        if (w == static_cast<int64_t>(out->size())) {
          out->resize(std::max<size_t>(64, 2 * out->size()));
          if (vals) vals->resize(out->size());
        }
        (*out)[w] = j;
        if (vals) std::memcpy(vals->data() + w, &u, sizeof(T));
        ++w;
      }
      ++c;
    }
  };
  for (; i + 4 * W <= e; i += 4 * W) {
    const vIu* q = reinterpret_cast<const vIu*>(p + i);
    const vI u0 = side_key<SIDE>(vI(q[0])), u1 = side_key<SIDE>(vI(q[1])), u2 = side_key<SIDE>(vI(q[2])),
             u3 = side_key<SIDE>(vI(q[3]));
    const vL h = (vL)((u0 > vt) | (u1 > vt) | (u2 > vt) | (u3 > vt));
    if (check) {   // over |x|: a side's keys hide the other side's NaN/Inf
      const vI a0 = SIDE == 0 ? u0 : q[0] & vm, a1 = SIDE == 0 ? u1 : q[1] & vm;
      const vI a2 = SIDE == 0 ? u2 : q[2] & vm, a3 = SIDE == 0 ? u3 : q[3] & vm;
      const vI m01 = a0 > a1 ? a0 : a1, m23 = a2 > a3 ? a2 : a3, m = m01 > m23 ? m01 : m23;
      vmax = m > vmax ? m : vmax;
    }
    if (!(h[0] | h[1] | h[2] | h[3])) continue;
    if (w + 4 * W > cap) {
      for (int64_t j = i; j < i + 4 * W; ++j) scalar(j);
      continue;
    }
    // Branchless compaction: write every slot, advance by the compare. Hits are ~random
    // inside a group, so a branch per element would mispredict on most hits.
    if (w + 4 * W > static_cast<int64_t>(out->size())) {
      out->resize(std::max<size_t>(w + 4 * W, 2 * out->size()));
      if (vals) vals->resize(out->size());
    }
    int64_t* o = out->data();
    T* vo = vals ? vals->data() : nullptr;
    const int64_t w0 = w;
    for (int64_t j = i; j < i + 4 * W; ++j) {
      I u;
      std::memcpy(&u, p + j, sizeof(T));
      u = side_key_s<SIDE>(u);
      o[w] = j;
      if (vo) std::memcpy(vo + w, &u, sizeof(T));  // |x| while in cache: no gather later
      w += u > tb ? 1 : 0;
    }
    c += w - w0;
  }
  for (; i < e; ++i) scalar(i);
  out->resize(w);
  if (vals) vals->resize(w);
  for (int l = 0; l < W; ++l) smax = vmax[l] > smax ? vmax[l] : smax;
  *count = c;
  *finite = smax < inf_bits;
}
// ---- select_above, AVX2 compaction ---------------------------------------------------------
// Where a message is dense (local steps send density x steps, about 10%), nearly every group of
// 32 holds a hit, and select_impl's compaction (every slot written, ~5 cycles an element) is the
// pass's cost: 14 ms for 16.8M floats at 10.7%, 2.8 ms at 0.1% (experiments/select_density.py).
// Here each vector of 8 is compacted by one lane permutation from a 256-entry table: its positions
// and keys are stored 8 at a time and the cursor moves by the popcount. The output is
// select_impl's (ascending positions, their keys), at any density. Within a chunk (kGrain
// elements) offsets fit int32.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
struct CompactTable {
  alignas(32) int32_t perm[256][8];
  CompactTable() {
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) perm[m][k++] = l;
      for (; k < 8; ++k) perm[m][k] = 0;
    }
  }
};
static const CompactTable kCompact;
static const bool kAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");

template <int SIDE>
__attribute__((target("avx2,popcnt"))) static inline __m256i side_key_avx2(__m256i bits) {
  if constexpr (SIDE == 0) return _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i k = SIDE > 0 ? bits : _mm256_xor_si256(bits, _mm256_set1_epi32(INT32_MIN));
  return _mm256_max_epi32(k, _mm256_setzero_si256());
}

template <int SIDE>
__attribute__((target("avx2,popcnt"))) static void select_avx2(
    const float* p, int64_t b, int64_t e, float t, bool check, std::vector<int64_t>* out,
    std::vector<float>* vals, int64_t* count, bool* finite) {
  if (t == 0) t = 0;  // -0.0 would compare below every +0 in the integer domain
  int32_t tb;
  std::memcpy(&tb, &t, 4);
  const __m256i vt = _mm256_set1_epi32(tb), vm = _mm256_set1_epi32(0x7fffffff);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), base = _mm256_set1_epi64x(b);
  __m256i vmax = _mm256_setzero_si256();
  int64_t w = 0, i = b;
  auto room = [&](int64_t n) {   // slots for n more writes past the cursor
    if (w + n > static_cast<int64_t>(out->size())) {
      out->resize(std::max<size_t>(std::max<int64_t>(w + n, 64), 2 * out->size()));
      if (vals) vals->resize(out->size());
    }
  };
  for (; i + 32 <= e; i += 32) {
    __m256i u[4], h[4];
    for (int q = 0; q < 4; ++q) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 8 * q));
      u[q] = side_key_avx2<SIDE>(bits);
      h[q] = _mm256_cmpgt_epi32(u[q], vt);
      if (check) vmax = _mm256_max_epi32(vmax, SIDE == 0 ? u[q] : _mm256_and_si256(bits, vm));
    }
    const __m256i any = _mm256_or_si256(_mm256_or_si256(h[0], h[1]), _mm256_or_si256(h[2], h[3]));
    if (_mm256_testz_si256(any, any)) continue;
    room(32);   // every store writes 8 slots
    for (int q = 0; q < 4; ++q) {
      const int m = _mm256_movemask_ps(_mm256_castsi256_ps(h[q]));
      const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompact.perm[m]));
      const __m256i pos = _mm256_permutevar8x32_epi32(
          _mm256_add_epi32(iota, _mm256_set1_epi32(static_cast<int32_t>(i + 8 * q - b))), perm);
      int64_t* o = out->data() + w;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                          _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(pos)), base));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 4),
                          _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(pos, 1)), base));
      if (vals)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(vals->data() + w), _mm256_permutevar8x32_epi32(u[q], perm));
      w += _mm_popcnt_u32(static_cast<unsigned>(m));
    }
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), vmax);
  int32_t smax = 0;
  for (int l = 0; l < 8; ++l) smax = lanes[l] > smax ? lanes[l] : smax;
  for (; i < e; ++i) {  // the tail, under 32 elements
    int32_t bits;
    std::memcpy(&bits, p + i, 4);
    smax = (bits & 0x7fffffff) > smax ? (bits & 0x7fffffff) : smax;
    const int32_t k = side_key_s<SIDE>(bits);
    if (k > tb) {
      room(1);
      (*out)[w] = i;
      if (vals) std::memcpy(vals->data() + w, &k, 4);
      ++w;
    }
  }
  out->resize(w);
  if (vals) vals->resize(w);
  *count = w;
  *finite = smax < 0x7f800000;
}
#else
static const bool kAvx2 = false;
#endif

RS_CLONES static void select_f(const float* p, int64_t b, int64_t e, float t, int64_t cap, bool ck,
                               std::vector<int64_t>* o, std::vector<float>* v, int64_t* c, bool* fin, int side) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  if (kAvx2 && cap >= e - b) {   // uncapped within the chunk: the vector compaction
    if (side == 0) select_avx2<0>(p, b, e, t, ck, o, v, c, fin);
    else if (side > 0) select_avx2<1>(p, b, e, t, ck, o, v, c, fin);
    else select_avx2<-1>(p, b, e, t, ck, o, v, c, fin);
    return;
  }
#endif
  if (side == 0) select_impl<float, 0>(p, b, e, t, cap, ck, o, v, c, fin);
  else if (side > 0) select_impl<float, 1>(p, b, e, t, cap, ck, o, v, c, fin);
  else select_impl<float, -1>(p, b, e, t, cap, ck, o, v, c, fin);
}
RS_CLONES static void select_d(const double* p, int64_t b, int64_t e, double t, int64_t cap, bool ck,
                               std::vector<int64_t>* o, std::vector<double>* v, int64_t* c, bool* fin) {
  select_impl<double, 0>(p, b, e, t, cap, ck, o, v, c, fin);
}
void check_side(const at::Tensor& x, int64_t side) {
  TORCH_CHECK(side >= -1 && side <= 1, "redsync native selection: side must be -1, 0 or 1, got ", side);
  TORCH_CHECK(side == 0 || x.scalar_type() == at::kFloat, "redsync native selection: a side's keys need float32");
}

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "redsync native selection: CPU tensors only");
  TORCH_CHECK(x.is_contiguous(), "redsync native selection: contiguous tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "redsync native selection: float32/float64 only");
}

int64_t n_chunks(int64_t n) { return std::max<int64_t>(1, (n + kGrain - 1) / kGrain); }

// Below two threads' worth of chunks run inline: at::parallel_for would still open an
// OpenMP region (wake-up + barrier) even when it hands all the work to one thread.
template <typename F>
void run_chunks(int64_t nc, const F& f) {
  if (nc < 2 * kChunksPerThread) f(0, nc);
  else at::parallel_for(0, nc, kChunksPerThread, f);
}

}  // namespace

// Returns (max|x|, sum|x|); sum is non-finite iff x (probably) holds NaN/Inf.
std::tuple<double, double> stats(const at::Tensor& x, int64_t side) {
  check_input(x);
  check_side(x, side);
  const int64_t n = x.numel(), nc = n_chunks(n);
  std::vector<double> mx(nc, 0.0), sm(nc, 0.0);
  const bool f32 = x.scalar_type() == at::kFloat;
  const void* base = x.data_ptr();
  run_chunks(nc, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * kGrain, e = std::min(n, b + kGrain);
      if (f32) stats_f(static_cast<const float*>(base), b, e, &mx[c], &sm[c], static_cast<int>(side));
      else stats_d(static_cast<const double*>(base), b, e, &mx[c], &sm[c]);
    }
  });
  double m = 0, s = 0;
  for (int64_t c = 0; c < nc; ++c) { m = std::max(m, mx[c]); s += sm[c]; }
  return {m, s};
}

// counts[j] = #{i : |x_i| > thr_j}; thr must have x's dtype.
at::Tensor count_multi(const at::Tensor& x, const at::Tensor& thr, int64_t side) {
  check_input(x);
  check_side(x, side);
  TORCH_CHECK(thr.scalar_type() == x.scalar_type() && thr.is_contiguous() && thr.device().is_cpu(),
              "count_multi: thresholds must be a contiguous CPU tensor of x's dtype");
  const int64_t n = x.numel(), nt = thr.numel(), nc = n_chunks(n);
  std::vector<int64_t> part(nc * nt, 0);
  const bool f32 = x.scalar_type() == at::kFloat;
  run_chunks(nc, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * kGrain, e = std::min(n, b + kGrain);
      if (f32) count_f(x.data_ptr<float>(), b, e, thr.data_ptr<float>(), nt, &part[c * nt], static_cast<int>(side));
      else count_d(x.data_ptr<double>(), b, e, thr.data_ptr<double>(), nt, &part[c * nt]);
    }
  });
  auto out = at::zeros({nt}, at::kLong);
  auto* o = out.data_ptr<int64_t>();
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t j = 0; j < nt; ++j) o[j] += part[c * nt + j];
  return out;
}

// Returns (indices of |x| > thr in ascending order, their |x| (empty unless
// with_values), total count, finite flag). Over `cap` hits both tensors are empty
// (the caller re-plans instead of paying for a huge write); the count stays exact.
template <typename T>
static std::tuple<at::Tensor, at::Tensor, int64_t, bool> select_typed(
    const at::Tensor& x, T thr, int64_t cap, bool check_finite, bool with_values, int side) {
  const int64_t n = x.numel(), nc = n_chunks(n);
  const T* p = x.data_ptr<T>();
  std::vector<std::vector<int64_t>> bufs(nc);
  std::vector<std::vector<T>> vbufs(with_values ? nc : 0);
  std::vector<int64_t> cnt(nc, 0);
  std::vector<char> fin(nc, 1);
  run_chunks(nc, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * kGrain, e = std::min(n, b + kGrain);
      bool f = true;
      if constexpr (std::is_same_v<T, float>)
        select_f(p, b, e, thr, cap, check_finite, &bufs[c], with_values ? &vbufs[c] : nullptr, &cnt[c], &f, side);
      else
        select_d(p, b, e, thr, cap, check_finite, &bufs[c], with_values ? &vbufs[c] : nullptr, &cnt[c], &f);
      fin[c] = f;
    }
  });
  std::vector<int64_t> off(nc + 1, 0);
  bool finite = true;
  for (int64_t c = 0; c < nc; ++c) {
    off[c + 1] = off[c] + cnt[c];
    finite = finite && fin[c];
  }
  const int64_t total = off[nc];
  const auto vopt = at::TensorOptions().dtype(x.scalar_type());
  if (total > cap) return {at::empty({0}, at::kLong), at::empty({0}, vopt), total, finite};
  auto out = at::empty({total}, at::kLong);
  auto vout = at::empty({with_values ? total : 0}, vopt);
  int64_t* o = out.data_ptr<int64_t>();
  T* vo = vout.data_ptr<T>();
  run_chunks(nc, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      std::copy(bufs[c].begin(), bufs[c].end(), o + off[c]);
      if (with_values) std::copy(vbufs[c].begin(), vbufs[c].end(), vo + off[c]);
    }
  });
  return {out, vout, total, finite};
}

std::tuple<at::Tensor, at::Tensor, int64_t, bool> select_above(
    const at::Tensor& x, double thr, int64_t cap, bool check_finite, bool with_values, int64_t side) {
  check_input(x);
  check_side(x, side);
  if (x.scalar_type() == at::kFloat)
    return select_typed<float>(x, static_cast<float>(thr), cap, check_finite, with_values, static_cast<int>(side));
  return select_typed<double>(x, thr, cap, check_finite, with_values, 0);
}


// ---- compensate_scan -------------------------------------------------------------------
// Error feedback's compensation fused with the first pass of the selection that follows (the
// native form of core/compensate.py:torch_compensate, its reference):
//   plain:              out = r + g
//   momentum correction: u_out = m*u + g;  out = r + (nesterov ? g + m*u_out : u_out)
// and, on the way, max|out|, sum|out| and the indices/|out| above `thr` (as select_above).
// One streaming pass where the unfused path makes two (torch.add, then a stats or select
// pass over the result), three with momentum correction. thr = inf asks for the
// statistics only (a search step). The step is computed in registers, stored once, and
// its |.| feeds the max, the sum and the threshold compare before the next load (a
// block-wise "compute, then stats, then select" re-read every block from cache and
// measured no faster than two passes). Max and finite check are integer maxima of the
// sign-cleared bits, as in select_impl; sums are float per 4096-block, then double, in
// stats_f's order.

// Streaming (non-temporal) stores for the layer-sized outputs: a normal store first reads
// the line it writes into cache (the output buffer is cold: another step's), so r + g into
// a fresh buffer moved four streams of memory; streamed, three. SSE stores (baseline
// x86-64) serve both clones; the caller fences once at the end.
template <typename V>
static inline __attribute__((always_inline)) void store8(float* p, const V& v, bool stream) {
#ifdef RS_STREAM
  if (stream) {
    __m128 lo, hi;
    std::memcpy(&lo, &v, 16);
    std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 16, 16);
    _mm_stream_ps(p, lo);
    _mm_stream_ps(p + 4, hi);
    return;
  }
#endif
  typedef float vFu __attribute__((vector_size(32), aligned(4), may_alias));
  *reinterpret_cast<vFu*>(p) = v;
}

// With SIDES: no scan; each sign's statistics instead of |x|'s (max and sum of max(x, 0) and of
// max(-x, 0), in stats_side's order), for a sign rule's two selections (side_max, side_sum: [2]).
template <int MODE, bool SIDES = false>
static inline __attribute__((always_inline)) void compensate_impl(
    const float* r, const float* g, const float* u, float* uo, float m, float* out, int64_t b, int64_t e,
    float t, bool scan, int64_t cap, std::vector<int64_t>* idx, std::vector<float>* vals, int64_t* count,
    int32_t* max_bits, double* sum_out, int32_t* side_max = nullptr, double* side_sum = nullptr) {
  constexpr int W = 8;
  typedef float vF __attribute__((vector_size(32)));
  typedef int32_t vI __attribute__((vector_size(32)));
  typedef int64_t vL __attribute__((vector_size(32)));
  typedef float vFu __attribute__((vector_size(32), aligned(4), may_alias));
  const vI absmask = vI{} + 0x7fffffff;
  if (t == 0) t = 0;
  int32_t tb = 0x7fffffff;   // no scan: nothing compares above
  if (scan) std::memcpy(&tb, &t, 4);
  const vI vt = vI{} + tb;
  const vF vm = vF{} + m;
  vI vmax = vI{}, vmp = vI{}, vmn = vI{};
  int32_t smax = 0, smp = 0, smn = 0;
  double sum = 0, sum_p = 0, sum_n = 0;
  int64_t c = 0, w = static_cast<int64_t>(idx->size());
  // blocks start at multiples of 8 elements from b, so one check covers every store
  const bool stream = (reinterpret_cast<uintptr_t>(out + b) % 16 == 0) &&
                      (MODE == 0 || reinterpret_cast<uintptr_t>(uo + b) % 16 == 0);
  auto step = [&](int64_t j) -> float {
    if (MODE == 0) return r[j] + g[j];
    const float un = g[j] + m * u[j];
    uo[j] = un;
    return MODE == 1 ? r[j] + un : r[j] + (g[j] + m * un);
  };
  auto hit = [&](int64_t j, int32_t bits) {
    if (w < cap) {
      if (w == static_cast<int64_t>(idx->size())) {
        idx->resize(std::max<size_t>(64, 2 * idx->size()));
        vals->resize(idx->size());
      }
      (*idx)[w] = j;
      std::memcpy(vals->data() + w, &bits, 4);
      ++w;
    }
    ++c;
  };
  for (int64_t b0 = b; b0 < e; b0 += 4096) {
    const int64_t e0 = std::min(e, b0 + 4096);
    vF acc = vF{}, accp = vF{}, accn = vF{};
    float sacc = 0, saccp = 0, saccn = 0;
    int64_t i = b0;
    for (; i + W <= e0; i += W) {
      const vF rv = *reinterpret_cast<const vFu*>(r + i), gv = *reinterpret_cast<const vFu*>(g + i);
      vF o;
      if (MODE == 0) {
        o = rv + gv;
      } else {
        const vF un = gv + vm * *reinterpret_cast<const vFu*>(u + i);
        store8(uo + i, un, stream);
        o = MODE == 1 ? rv + un : rv + (gv + vm * un);
      }
      store8(out + i, o, stream);
      if constexpr (SIDES) {
        const vI bits = reinterpret_cast<vI>(o), kp = side_key<1>(bits), kn = side_key<-1>(bits);
        const vI a = bits & absmask;
        accp += reinterpret_cast<vF>(kp);
        accn += reinterpret_cast<vF>(kn);
        vmp = kp > vmp ? kp : vmp;
        vmn = kn > vmn ? kn : vmn;
        vmax = a > vmax ? a : vmax;
        continue;
      }
      const vI a = reinterpret_cast<vI>(o) & absmask;
      acc += reinterpret_cast<vF>(a);
      vmax = a > vmax ? a : vmax;
      const vL h = reinterpret_cast<vL>(a > vt);
      if (!(h[0] | h[1] | h[2] | h[3])) continue;
      for (int l = 0; l < W; ++l)
        if (a[l] > tb) hit(i + l, a[l]);
    }
    for (; i < e0; ++i) {  // tail
      const float o = step(i);
      out[i] = o;
      if constexpr (SIDES) {
        int32_t bits;
        std::memcpy(&bits, &o, 4);
        const int32_t kp = side_key_s<1>(bits), kn = side_key_s<-1>(bits), a = bits & 0x7fffffff;
        float fp, fn;
        std::memcpy(&fp, &kp, 4);
        std::memcpy(&fn, &kn, 4);
        saccp += fp;
        saccn += fn;
        smp = kp > smp ? kp : smp;
        smn = kn > smn ? kn : smn;
        smax = a > smax ? a : smax;
        continue;
      }
      const int32_t a = abs_accumulate(o, &sacc, &smax);
      if (a > tb) hit(i, a);
    }
    for (int l = 0; l < W; ++l) {
      sacc += acc[l];
      saccp += accp[l];
      saccn += accn[l];
    }
    sum += static_cast<double>(sacc);
    sum_p += static_cast<double>(saccp);
    sum_n += static_cast<double>(saccn);
  }
  for (int l = 0; l < W; ++l) {
    smax = vmax[l] > smax ? vmax[l] : smax;
    smp = vmp[l] > smp ? vmp[l] : smp;
    smn = vmn[l] > smn ? vmn[l] : smn;
  }
  if constexpr (SIDES) {
    side_max[0] = std::max(side_max[0], smp);
    side_max[1] = std::max(side_max[1], smn);
    side_sum[0] += sum_p;
    side_sum[1] += sum_n;
  }
#ifdef RS_STREAM
  if (stream) _mm_sfence();   // streamed stores are visible before the caller reads them
#endif
  idx->resize(w);
  vals->resize(w);
  *count += c;
  *max_bits = std::max(*max_bits, smax);
  *sum_out += sum;
}
RS_CLONES static void compensate_f(int mode, const float* r, const float* g, const float* u, float* uo, float m,
                                   float* out, int64_t b, int64_t e, float t, bool scan, int64_t cap,
                                   std::vector<int64_t>* idx, std::vector<float>* vals, int64_t* count,
                                   int32_t* max_bits, double* sum) {
  if (mode == 0) compensate_impl<0>(r, g, u, uo, m, out, b, e, t, scan, cap, idx, vals, count, max_bits, sum);
  else if (mode == 1) compensate_impl<1>(r, g, u, uo, m, out, b, e, t, scan, cap, idx, vals, count, max_bits, sum);
  else compensate_impl<2>(r, g, u, uo, m, out, b, e, t, scan, cap, idx, vals, count, max_bits, sum);
}

RS_CLONES static void compensate_sides_f(int mode, const float* r, const float* g, const float* u, float* uo,
                                         float m, float* out, int64_t b, int64_t e, int32_t* max_bits,
                                         int32_t* side_max, double* side_sum) {
  std::vector<int64_t> idx;
  std::vector<float> vals;
  int64_t count = 0;
  double sum = 0;
  if (mode == 0)
    compensate_impl<0, true>(r, g, u, uo, m, out, b, e, 0, false, 0, &idx, &vals, &count, max_bits, &sum, side_max,
                             side_sum);
  else if (mode == 1)
    compensate_impl<1, true>(r, g, u, uo, m, out, b, e, 0, false, 0, &idx, &vals, &count, max_bits, &sum, side_max,
                             side_sum);
  else
    compensate_impl<2, true>(r, g, u, uo, m, out, b, e, 0, false, 0, &idx, &vals, &count, max_bits, &sum, side_max,
                             side_sum);
}

static void check_compensate(const at::Tensor& r, const at::Tensor& g, const at::Tensor& out, const at::Tensor& u,
                             const at::Tensor& u_out, bool mc) {
  const int64_t n = r.numel();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&r, &g, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == n,
                "compensate_scan: r, g and out must be contiguous CPU float32 tensors of one size");
  }
  if (mc) {
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&u, &u_out}) {
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == at::kFloat && t->numel() == n,
                  "compensate_scan: u and u_out must be contiguous CPU float32 tensors of r's size");
    }
  }
}

// compensate_scan's step with each sign's statistics: (finite, max and sum of max(out, 0), max and
// sum of max(-out, 0)), in stats(x, 1) and stats(x, -1)'s order.
std::tuple<bool, double, double, double, double> compensate_sides(
    const at::Tensor& r, const at::Tensor& g, at::Tensor& out, const at::Tensor& u, at::Tensor& u_out,
    double momentum, bool nesterov) {
  const bool mc = u.defined() && u.numel() > 0;
  check_compensate(r, g, out, u, u_out, mc);
  const int64_t n = r.numel(), nc = n_chunks(n);
  const int mode = !mc ? 0 : nesterov ? 2 : 1;
  std::vector<int32_t> mx(nc, 0), smx(2 * nc, 0);
  std::vector<double> ssm(2 * nc, 0.0);
  const float* up = mc ? u.data_ptr<float>() : nullptr;
  float* uop = mc ? u_out.data_ptr<float>() : nullptr;
  run_chunks(nc, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * kGrain, e = std::min(n, b + kGrain);
      compensate_sides_f(mode, r.data_ptr<float>(), g.data_ptr<float>(), up, uop, static_cast<float>(momentum),
                         out.data_ptr<float>(), b, e, &mx[c], &smx[2 * c], &ssm[2 * c]);
    }
  });
  int32_t m_bits = 0, mp = 0, mn = 0;
  double sp = 0, sn = 0;
  for (int64_t c = 0; c < nc; ++c) {
    m_bits = std::max(m_bits, mx[c]);
    mp = std::max(mp, smx[2 * c]);
    mn = std::max(mn, smx[2 * c + 1]);
    sp += ssm[2 * c];
    sn += ssm[2 * c + 1];
  }
  float fp, fn;
  std::memcpy(&fp, &mp, 4);
  std::memcpy(&fn, &mn, 4);
  return {m_bits < 0x7f800000, fp, sp, fn, sn};
}

std::tuple<at::Tensor, at::Tensor, int64_t, bool, double, double> compensate_scan(
    const at::Tensor& r, const at::Tensor& g, at::Tensor& out, const at::Tensor& u, at::Tensor& u_out,
    double momentum, bool nesterov, double thr, int64_t cap) {
  const int64_t n = r.numel();
  const bool mc = u.defined() && u.numel() > 0;
  check_compensate(r, g, out, u, u_out, mc);
  const float* rp = r.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* up = mc ? u.data_ptr<float>() : nullptr;
  float* uop = mc ? u_out.data_ptr<float>() : nullptr;
  const float m = static_cast<float>(momentum), t = static_cast<float>(thr);
  const bool scan = std::isfinite(t);
  const int64_t nc = n_chunks(n);
  const int mode = !mc ? 0 : nesterov ? 2 : 1;
  std::vector<std::vector<int64_t>> bufs(nc);
  std::vector<std::vector<float>> vbufs(nc);
  std::vector<int64_t> cnt(nc, 0);
  std::vector<int32_t> mx(nc, 0);
  std::vector<double> sm(nc, 0.0);
  run_chunks(nc, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = c * kGrain, e = std::min(n, b + kGrain);
      compensate_f(mode, rp, gp, up, uop, m, op, b, e, t, scan, cap, &bufs[c], &vbufs[c], &cnt[c], &mx[c], &sm[c]);
    }
  });
  std::vector<int64_t> off(nc + 1, 0);
  int32_t m_bits = 0;
  double s_all = 0;
  for (int64_t c = 0; c < nc; ++c) {
    off[c + 1] = off[c] + cnt[c];
    m_bits = std::max(m_bits, mx[c]);
    s_all += sm[c];
  }
  float m_f;
  std::memcpy(&m_f, &m_bits, 4);
  const double m_all = m_f;
  // NaN's bits sort above Inf's: one integer max is the finite check
  const bool finite = m_bits < 0x7f800000;
  const int64_t total = off[nc];
  const auto fopt = at::TensorOptions().dtype(at::kFloat);
  if (!scan || total > cap) return {at::empty({0}, at::kLong), at::empty({0}, fopt), total, finite, m_all, s_all};
  auto idx_out = at::empty({total}, at::kLong);
  auto val_out = at::empty({total}, fopt);
  for (int64_t c = 0; c < nc; ++c) {
    std::copy(bufs[c].begin(), bufs[c].end(), idx_out.data_ptr<int64_t>() + off[c]);
    std::copy(vbufs[c].begin(), vbufs[c].end(), val_out.data_ptr<float>() + off[c]);
  }
  return {idx_out, val_out, total, finite, m_all, s_all};
}

namespace py = pybind11;

void register_exact(py::module& m);   // exact_kernels.cpp: exactly k among a layer's candidates
void register_golomb(py::module& m);  // golomb_kernels.cpp: Golomb-Rice positions, code by code

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "redsync_hvd fused selection passes (CPU)";
  m.attr("KERNELS") = 5;   // the loader refuses a module built from an older version of this file
  m.def("stats", &stats, "(max key, sum of keys) in one pass; the sum is inf where x is not finite", py::arg("x"),
        py::arg("side") = 0);
  m.def("count_multi", &count_multi, "#{key > t_j} for every threshold, one pass", py::arg("x"), py::arg("thr"),
        py::arg("side") = 0);
  m.def("compensate_scan", &compensate_scan,
        "out = r + g (or DGC's momentum-corrected step), fused with stats and select_above over out",
        py::arg("r"), py::arg("g"), py::arg("out"), py::arg("u"), py::arg("u_out"), py::arg("momentum"),
        py::arg("nesterov"), py::arg("thr"), py::arg("cap"));
  m.def("compensate_sides", &compensate_sides,
        "compensate_scan's step with each sign's statistics: (finite, max, sum of max(out, 0), max, sum of max(-out, 0))",
        py::arg("r"), py::arg("g"), py::arg("out"), py::arg("u"), py::arg("u_out"), py::arg("momentum"),
        py::arg("nesterov"));
  m.def("select_above", &select_above, "(indices of key > thr ascending, their keys, count, finite flag)",
        py::arg("x"), py::arg("thr"), py::arg("cap"), py::arg("check_finite"), py::arg("with_values") = false,
        py::arg("side") = 0);
  register_exact(m);
  register_golomb(m);
}
