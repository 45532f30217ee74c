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
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r][j] = x[r] . w[j] for r < MR rows (stride xs), j < 3 outputs (stride ws); K % 8 == 0.
// `next`: the following tile's first weight row (or nullptr): prefetched while this one computes.
template <int MR>
inline void tile(const float* x, int64_t xs, const float* w, int64_t ws, int64_t k, float* out, int64_t os,
                 const float* next) {
  __m256 acc[MR][3];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* w0 = w;
  const float* w1 = w + ws;
  const float* w2 = w + 2 * ws;
  for (int64_t i = 0; i < k; i += 8) {
    if (next != nullptr && (i & 15) == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + ws + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + 2 * ws + i), _MM_HINT_T0);
    }
    const __m256 a = _mm256_loadu_ps(w0 + i), b = _mm256_loadu_ps(w1 + i), c = _mm256_loadu_ps(w2 + i);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * xs + i);
      acc[r][0] = _mm256_fmadd_ps(xv, a, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, b, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xv, c, acc[r][2]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) out[r * os + j] = hsum(acc[r][j]);
}
#endif

#if defined(__AVX512F__)
// The AVX-512 form of `tile`: 16 lanes along K, up to 8 rows x 3 outputs = 24 of the 32 zmm
// registers, so each weight vector is loaded once per 8 rows; K % 16 == 0. On a Zen 4 VM, 30
// layers of SmolLM2's shapes: 16 rows 35.1 / 34.9 -> 32.6 / 32.1 ms, 8 rows 24.7 / 23.7 -> 22.3 /
// 21.3 ms against the AVX2 tile (two alternating pairs).
template <int MR>
inline void tile16(const float* x, int64_t xs, const float* w, int64_t ws, int64_t k, float* out, int64_t os,
                   const float* next) {
  __m512 acc[MR][3];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* w0 = w;
  const float* w1 = w + ws;
  const float* w2 = w + 2 * ws;
  for (int64_t i = 0; i < k; i += 16) {
    if (next != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(next + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + ws + i), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(next + 2 * ws + i), _MM_HINT_T0);
    }
    const __m512 a = _mm512_loadu_ps(w0 + i), b = _mm512_loadu_ps(w1 + i), c = _mm512_loadu_ps(w2 + i);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * xs + i);
      acc[r][0] = _mm512_fmadd_ps(xv, a, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, b, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, c, acc[r][2]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 3; ++j) out[r * os + j] = _mm512_reduce_add_ps(acc[r][j]);
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
#if defined(__AVX512F__)
      if (nn == NR && K % 16 == 0) {
        const float* next = n0 + 2 * NR <= N ? wp + (n0 + NR) * K : nullptr;
        int64_t r = 0;
        for (; r + 8 <= M; r += 8) tile16<8>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
        for (; r + 4 <= M; r += 4) tile16<4>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
        for (; r < M; ++r) tile16<1>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
      } else
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if (nn == NR && K % 8 == 0) {
        // prefetch the next tile during the first pass over this one (later passes hit L1)
        const float* next = n0 + 2 * NR <= N ? wp + (n0 + NR) * K : nullptr;
        int64_t r = 0;
        for (; r + 4 <= M; r += 4) tile<4>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
        for (; r < M; ++r) tile<1>(xp + r * xs, xs, wp + n0 * K, K, K, op + r * N + n0, N, r == 0 ? next : nullptr);
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
