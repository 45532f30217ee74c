// y = x W^T + b for few rows of x (decode steps, short chunks) on CPU, float32.
//
// At 16 rows oneDNN's and MKL's GEMMs run a streamed weight at 6-9 GB/s, a third of what the
// memory delivers, so a decode step's matmuls cost twice what reading the weights does. This
// kernel reads W as it is stored ([N, K], row-major: each output's weights contiguous): a tile of
// 3 outputs x 4 rows keeps 12 accumulators of 8 lanes along K, so each 8-float piece of W is
// loaded once per 4 rows and every x piece once per 3 outputs (with AVX-512: 3 outputs x 8 rows
// of 16 lanes, each piece of W loaded once per 8 rows); one horizontal sum per output and row at
// the end. The 3 weight rows of a tile (3 x 4 x K bytes) stay in L1 while every block
// of 4 rows passes over them, so W comes from memory once. Tiles of outputs are shared between
// threads. No repacked copy of the weight is needed.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

inline float dot_generic(const float* a, const float* b, int64_t k) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < k; ++i) acc += a[i] * b[i];
  return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
// One vector width's operations for `tile`: 8 lanes (AVX2) or, where the CPU has it, 16 (AVX-512).
struct Vec8 {
  using type = __m256;
  static constexpr int lanes = 8;
  static type zero() { return _mm256_setzero_ps(); }
  static type load(const float* p) { return _mm256_loadu_ps(p); }
  static type fma(type a, type b, type c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(type v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

#if defined(__AVX512F__)
// 16 lanes: up to 8 rows x 3 outputs = 24 of the 32 zmm registers, so each weight vector is loaded
// once per 8 rows. On a Zen 4 VM, 30 layers of SmolLM2's shapes: 16 rows 35.1 / 34.9 -> 32.6 /
// 32.1 ms, 8 rows 24.7 / 23.7 -> 22.3 / 21.3 ms against the 8-lane tile (two alternating pairs).
struct Vec16 {
  using type = __m512;
  static constexpr int lanes = 16;
  static type zero() { return _mm512_setzero_ps(); }
  static type load(const float* p) { return _mm512_loadu_ps(p); }
  static type fma(type a, type b, type c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(type v) { return _mm512_reduce_add_ps(v); }
};
#endif

// out[r][j] = x[r] . w[j] for r < MR rows (stride xs), j < 3 outputs (stride ws); K % V::lanes == 0.
// `next`: the following tile's first weight row (or nullptr): prefetched while this one computes,
// one cache line (16 floats) of each of its 3 rows at a time.
template <class V, int MR>
inline void tile(const float* x, int64_t xs, const float* w, int64_t ws, int64_t k, float* out, int64_t os,
                 const float* next) {
  typename V::type acc[MR][3];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = V::zero();
  const float* w0 = w;
  const float* w1 = w + ws;
  const float* w2 = w + 2 * ws;
  for (int64_t i = 0; i < k; i += V::lanes) {
    if (next != nullptr && (i & 15) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + ws + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + 2 * ws + i), _MM_HINT_T0);
    }
    const typename V::type a = V::load(w0 + i), b = V::load(w1 + i), c = V::load(w2 + i);
    for (int r = 0; r < MR; ++r) {
      const typename V::type xv = V::load(x + r * xs + i);
      acc[r][0] = V::fma(xv, a, acc[r][0]);
      acc[r][1] = V::fma(xv, b, acc[r][1]);
      acc[r][2] = V::fma(xv, c, acc[r][2]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) out[r * os + j] = V::sum(acc[r][j]);
}
#endif

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x must be float32 [M, K] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.size(1) == x.size(1),
              "weight must be contiguous float32 [N, K] matching x");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kFloat, "bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  constexpr int64_t NR = 3;
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR, nn = std::min(NR, N - n0);
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
      if (nn == NR && K % 16 == 0) {
        const float* next = n0 + 2 * NR <= N ? wp + (n0 + NR) * K : nullptr;
        int64_t r = 0;
        for (; r + 8 <= M; r += 8) tile<Vec16, 8>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
        for (; r + 4 <= M; r += 4) tile<Vec16, 4>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
        for (; r < M; ++r) tile<Vec16, 1>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
      } else
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if (nn == NR && K % 8 == 0) {
        // prefetch the next tile during the first pass over this one (later passes hit L1)
        const float* next = n0 + 2 * NR <= N ? wp + (n0 + NR) * K : nullptr;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) tile<Vec8, 4>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
        for (; r < M; ++r) tile<Vec8, 1>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
      } else
#endif
      {
        for (int64_t r = 0; r < M; ++r)
          for (int64_t j = 0; j < nn; ++j) op[r * N + n0 + j] = dot_generic(xp + r * xs, wp + (n0 + j) * K, K);
      }
      if (bp != nullptr)
        for (int64_t r = 0; r < M; ++r)
          for (int64_t j = 0; j < nn; ++j) op[r * N + n0 + j] += bp[n0 + j];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgate, m) { m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvgate, CPU, m) { m.impl("small_linear", &small_linear); }
