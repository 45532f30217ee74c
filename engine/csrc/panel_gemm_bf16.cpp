// y = x W^T + b on CPU in bfloat16, float32 sums, for any number of rows: the bfloat16 form of
// panel_gemm.cpp, on CPUs with AVX512-BF16 (`vdpbf16ps`: each float32 lane adds two bfloat16
// products, so a vector of weights covers 16 outputs at two input features), and on AVX2 CPUs,
// which widen panels of the same layout, 16 outputs wide, to float32 in registers (the tiles at
// the end): half the weight bytes of float32 to stream, where PyTorch's bfloat16 matmul there
// runs several times slower than its float32 one (docs/engine.md).
//
// W [N, K] is repacked once into panels of kWidth = 32 outputs (16 on AVX2), each [K / 2][32][2]:
// for every pair of input features, the 32 outputs' two weights side by side, so one panel is one
// sequential stream and two vectors of it feed 32 outputs for two features. A tile covers two
// adjacent panels and up to kRows rows: per feature pair, four weight vectors and one broadcast
// of each row's two x values (a 32-bit load) feed 4 x kRows `vdpbf16ps`. As in the float32 kernel
// the pair of panels stays in L2 while every row block passes over it, and the row blocks
// prefetch the pair after next, each its slice. Each output is rounded to bfloat16 once, after
// the float32 sum (and the bias), as oneDNN's bfloat16 matmul does.
//
// A gated MLP's gate|up weight packed with `pack_panels_bf16(w, gated=true)` pairs gate output i
// with up output i in one panel (first 16 gate, then the 16 up), and `gated_panel_linear_bf16`
// writes SiLU(gate) * up rounded the way transformers' bfloat16 modules round it (gate and up to
// bfloat16, SiLU(gate) to bfloat16, the product to bfloat16), or gate | up.
//
// Shapes: x [M, K] bfloat16 (any row stride, unit column stride), K even; panels [P, K / 2, kWidth, 2]
// bfloat16 from `pack_panels_bf16`; bias [N] (gated: [2 I]) bfloat16 or none. Without AVX512-BF16,
// or AVX2 with FMA and no AVX-512, in the build the ops raise, and `bf16_panels_built()` says false.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#include "vec_math.h"

#if defined(__AVX512BF16__)
#define KVGATE_BF16_DOT 1    // tiles multiply pairs on `vdpbf16ps`
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// tiles widen the pairs to float32 and multiply on FMA (AVX-512 CPUs without BF16 keep oneDNN's
// bfloat16 matmul, which has AVX-512 kernels there; the widening tile is measured on AVX2 only)
#define KVGATE_BF16_WIDEN 1
#endif

#if defined(KVGATE_BF16_DOT) || defined(KVGATE_BF16_WIDEN)
#include <immintrin.h>

#include "panel_schedule.h"
#endif

namespace {

using kvgate::bf16;
#if defined(KVGATE_BF16_WIDEN)
constexpr int kWidth = 16;  // outputs per panel: two vectors of 8 pairs
#else
constexpr int kWidth = 32;  // outputs per panel: two vectors of 16 pairs
#endif
constexpr int kHalf = kWidth / 2;  // outputs per vector (a gated panel: its gates, then its ups)


enum class Out { kPlain, kSplit, kSiluMul };

bool built() {
#if defined(KVGATE_BF16_DOT) || defined(KVGATE_BF16_WIDEN)
  return true;
#else
  return false;
#endif
}

void check_weight(const at::Tensor& weight, bool gated) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "pack_panels_bf16 takes a 2-D bfloat16 CPU weight [out_features, in_features]");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack_panels_bf16: in_features must be even, got ", weight.size(1));
  TORCH_CHECK(!gated || weight.size(0) % 2 == 0, "pack_panels_bf16: a gated weight stacks gate and up rows (",
              weight.size(0), " rows is odd)");
}

// Panels [P, K / 2, kWidth, 2] of `weight` [N, K] (outputs past N zero); `gated`: panel p holds gate
// outputs p * kHalf ... then the up outputs of the same indices.
at::Tensor pack_panels_bf16(const at::Tensor& weight, bool gated) {
  check_weight(weight, gated);
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, half = N / 2;
  const int64_t P = gated ? (half + kHalf - 1) / kHalf : (N + kWidth - 1) / kWidth;
  at::Tensor out = at::zeros({P, K2, kWidth, 2}, w.options());
  const bf16* src = reinterpret_cast<const bf16*>(w.data_ptr());
  bf16* dst = reinterpret_cast<bf16*>(out.data_ptr());
  const auto source_row = [&](int64_t p, int64_t j) -> int64_t {
    if (!gated) return p * kWidth + j < N ? p * kWidth + j : -1;
    const int64_t i = p * kHalf + j % kHalf;
    return i < half ? (j < kHalf ? i : half + i) : -1;
  };
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kWidth; ++j) {
        const int64_t n = source_row(p, j);
        if (n < 0) continue;
        for (int64_t k = 0; k < K; ++k) dst[((p * K2 + k / 2) * kWidth + j) * 2 + k % 2] = src[n * K + k];
      }
  });
  return out;
}

#if defined(__AVX512BF16__)
constexpr int kRows = 6;

// Float32 lanes to bfloat16 and back (round to nearest even): a value as a bfloat16 tensor holds it.
inline __m512 rounded(__m512 v) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// `n` (<= 16) bfloat16 values at p as float32 lanes (0 past n, or everywhere for a null p).
inline __m512 load_bf16(const bf16* p, __mmask16 mask) {
  if (p == nullptr) return _mm512_setzero_ps();
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store_bf16(bf16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// One row's outputs of a panel from its two accumulators: 32 plain outputs (`lo` the first 16),
// or 16 gated ones (`lo` the gates, `hi` the ups); `cols` of them valid.
template <Out out>
inline void write_row(__m512 lo, __m512 hi, const bf16* bias, const bf16* bias_up, bf16* y, bf16* y_up,
                      int64_t cols) {
  if (out == Out::kPlain) {
    const __mmask16 m0 = kvgate::first_lanes(cols), m1 = kvgate::first_lanes(cols - 16);
    store_bf16(y, _mm512_add_ps(lo, load_bf16(bias, m0)), m0);
    if (cols > 16) store_bf16(y + 16, _mm512_add_ps(hi, load_bf16(bias ? bias + 16 : nullptr, m1)), m1);
    return;
  }
  const __mmask16 m = kvgate::first_lanes(cols);
  const __m512 gate = rounded(_mm512_add_ps(lo, load_bf16(bias, m)));
  const __m512 up = rounded(_mm512_add_ps(hi, load_bf16(bias_up, m)));
  if (out == Out::kSplit) {
    store_bf16(y, gate, m);
    store_bf16(y_up, up, m);
    return;
  }
  using vec = kvgate::f32xw;
  const vec g = (vec)gate;
  const __m512 silu = rounded((__m512)kvgate::silu_mul_lanes<vec, kvgate::i32xw>(g, kvgate::splatw(1.0f)));
  store_bf16(y, _mm512_mul_ps(silu, up), m);
}

// R rows at x times V adjacent panels (the second `next` elements after the first) over K2
// feature pairs, prefetching `ahead`'s slice of its panels as it goes.
template <int R, int V, Out out>
void tile(const bf16* x, int64_t ldx, const bf16* panel, int64_t next, int64_t K2,
          const kvgate::Ahead<bf16>& ahead, const bf16* bias, const bf16* bias_up, bf16* y, bf16* y_up, int64_t ldy,
          int64_t cols) {
  constexpr int64_t per_panel = out == Out::kPlain ? kWidth : kHalf;
  __m512 acc[R][2 * V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * V; ++j) acc[r][j] = _mm512_setzero_ps();
  const auto slice = ahead.slice(K2);
  const bf16* pre = ahead.panels == nullptr ? nullptr : ahead.panels + slice.first * kWidth * 2;
  int64_t left = pre == nullptr ? 0 : slice.count, due = 1;
  for (int64_t k = 0; k < K2; ++k) {
    const bf16* w = panel + k * kWidth * 2;
    __m512bh b[2 * V];
    for (int v = 0; v < V; ++v) {
      b[2 * v] = (__m512bh)_mm512_loadu_si512(w + v * next);
      b[2 * v + 1] = (__m512bh)_mm512_loadu_si512(w + v * next + 2 * kHalf);
    }
    if (--due == 0 && left > 0) {
      for (int v = 0; v < V; ++v) {
        __builtin_prefetch(pre + v * next, 0, 3);
        __builtin_prefetch(pre + v * next + 32, 0, 3);
      }
      pre += kWidth * 2, --left, due = slice.every;
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * k, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 2 * V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t c = v * per_panel, n = std::min(per_panel, cols - c);
      if (n <= 0) continue;
      write_row<out>(acc[r][2 * v], acc[r][2 * v + 1], bias ? bias + c : nullptr, bias_up ? bias_up + c : nullptr,
                     y + r * ldy + c, y_up ? y_up + r * ldy + c : nullptr, n);
    }
}

using TileFn = void (*)(const bf16*, int64_t, const bf16*, int64_t, int64_t, const kvgate::Ahead<bf16>&,
                        const bf16*, const bf16*, bf16*, bf16*, int64_t, int64_t);

template <int V, Out out, int... Rs>
TileFn tile_for(int rows, std::integer_sequence<int, Rs...>) {
  constexpr TileFn tiles[] = {&tile<Rs + 1, V, out>...};
  return tiles[rows - 1];
}

template <int V>
TileFn tile_of(int rows, Out out) {
  const auto sizes = std::make_integer_sequence<int, kRows>{};
  return out == Out::kPlain ? tile_for<V, Out::kPlain>(rows, sizes)
         : out == Out::kSplit ? tile_for<V, Out::kSplit>(rows, sizes)
                              : tile_for<V, Out::kSiluMul>(rows, sizes);
}
#endif

#if defined(KVGATE_BF16_WIDEN)
// AVX2: no bfloat16 products, so a tile widens each weight pair to float32 in registers (a pair
// is one 32-bit lane: the even feature's bits are its low half, the odd feature's its high half,
// so a shift and a mask give both as float32) and multiplies on FMA against x, widened once per
// call. Panels are 16 outputs wide here (a pair row is one 64-byte line, two vectors), as the
// float32 AVX2 panels are, and a tile covers one panel and up to kWideRows rows: per feature pair
// 2 loads, 4 widening ops and 2 x rows broadcasts feed 4 x rows FMAs, the float32 AVX2 tile's
// ratio. A tile of one or two rows keeps the odd features' sums apart, so that two FMAs in a
// row do not wait on each other.
constexpr int kWideRows = 5;  // 5 x 2 accumulators, 4 widened weights, 1 broadcast, the mask
using kvgate::f32x8;

// v as bfloat16 holds it, lane by lane (round to nearest even; NaN stays NaN)
inline f32x8 held8(f32x8 v) {
  return reinterpret_cast<f32x8>(kvgate::bf16_rounded_bits(reinterpret_cast<kvgate::u32x8>(v)));
}

inline f32x8 load_bias8(const bf16* p, int64_t n) {
  f32x8 v{};
  if (p != nullptr)
    for (int64_t j = 0; j < n && j < 8; ++j) v[j] = kvgate::to_float(p[j]);
  return v;
}

inline void store8(bf16* y, f32x8 v, int64_t n) {  // v already rounded: its high halves
  for (int64_t j = 0; j < n && j < 8; ++j) y[j] = static_cast<bf16>(__builtin_bit_cast(uint32_t, v[j]) >> 16);
}

template <int R, Out out>
void wide_tile(const float* x, int64_t ldx, const bf16* w, int64_t K2, const kvgate::Ahead<bf16>& ahead,
               const bf16* bias, const bf16* bias_up, bf16* y, bf16* y_up, int64_t ldy, int64_t cols) {
  constexpr int A = R <= 2 ? 2 : 1;  // sums per output: even and odd features apart for few rows
  __m256 acc[A][R][2];
#pragma GCC unroll 16
  for (int i = 0; i < A * R * 2; ++i) acc[i / (2 * R)][(i / 2) % R][i % 2] = _mm256_setzero_ps();
  const auto slice = ahead.slice(K2);
  const bf16* pre = ahead.panels == nullptr ? nullptr : ahead.panels + slice.first * kWidth * 2;
  int64_t left = pre == nullptr ? 0 : slice.count, due = 1;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int64_t k = 0; k < K2; ++k) {
    const __m256i* wk = reinterpret_cast<const __m256i*>(w + k * kWidth * 2);
    const __m256i a = _mm256_loadu_si256(wk), b = _mm256_loadu_si256(wk + 1);
    const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(a, 16));
    const __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(a, high));
    const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(b, high));
    if (--due == 0 && left > 0) {
      __builtin_prefetch(pre, 0, 3);
      pre += kWidth * 2, --left, due = slice.every;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 even = _mm256_broadcast_ss(x + r * ldx + 2 * k);
      acc[0][r][0] = _mm256_fmadd_ps(even, a0, acc[0][r][0]);
      acc[0][r][1] = _mm256_fmadd_ps(even, b0, acc[0][r][1]);
      const __m256 odd = _mm256_broadcast_ss(x + r * ldx + 2 * k + 1);
      acc[A - 1][r][0] = _mm256_fmadd_ps(odd, a1, acc[A - 1][r][0]);
      acc[A - 1][r][1] = _mm256_fmadd_ps(odd, b1, acc[A - 1][r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    f32x8 lo = reinterpret_cast<f32x8>(acc[0][r][0]), hi = reinterpret_cast<f32x8>(acc[0][r][1]);
    if constexpr (A == 2) {
      lo += reinterpret_cast<f32x8>(acc[1][r][0]);
      hi += reinterpret_cast<f32x8>(acc[1][r][1]);
    }
    bf16* yr = y + r * ldy;
    if constexpr (out == Out::kPlain) {  // 16 outputs
      store8(yr, held8(lo + load_bias8(bias, cols)), cols);
      if (cols > 8) store8(yr + 8, held8(hi + load_bias8(bias ? bias + 8 : nullptr, cols - 8)), cols - 8);
      continue;
    }
    const f32x8 gate = held8(lo + load_bias8(bias, cols)), up = held8(hi + load_bias8(bias_up, cols));
    if constexpr (out == Out::kSplit) {
      store8(yr, gate, cols);
      store8(y_up + r * ldy, up, cols);
    } else {
      const f32x8 silu = held8(kvgate::silu_mul_lanes<f32x8, kvgate::i32x8>(gate, f32x8{} + 1.0f));
      store8(yr, held8(silu * up), cols);
    }
  }
}

using WideFn = void (*)(const float*, int64_t, const bf16*, int64_t, const kvgate::Ahead<bf16>&, const bf16*,
                        const bf16*, bf16*, bf16*, int64_t, int64_t);

template <Out out, int... Rs>
WideFn wide_for(int rows, std::integer_sequence<int, Rs...>) {
  constexpr WideFn tiles[] = {&wide_tile<Rs + 1, out>...};
  return tiles[rows - 1];
}

WideFn wide_of(int rows, Out out) {
  const auto sizes = std::make_integer_sequence<int, kWideRows>{};
  return out == Out::kPlain ? wide_for<Out::kPlain>(rows, sizes)
         : out == Out::kSplit ? wide_for<Out::kSplit>(rows, sizes)
                              : wide_for<Out::kSiluMul>(rows, sizes);
}

// x [M, K] bfloat16 widened once to float32 [M, K] (the tiles broadcast from it).
at::Tensor widened(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  at::Tensor out = at::empty({M, K}, x.options().dtype(at::kFloat));
  const bf16* src = reinterpret_cast<const bf16*>(x.data_ptr());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t k = 0; k < K; ++k) dst[r * K + k] = kvgate::to_float(src[r * ldx + k]);
  });
  return out;
}

// Every panel of the layer over every row tile, panels shared between threads; the tiles over a
// panel prefetch the panel after next, each its slice, as the float32 AVX2 tiles do. All rows in
// one block: walking the panels once per L2's worth of rows, which the float32 tile gains from,
// measured no faster for this tile (its widening ops keep it busy beside the x stream).
void run_wide(const at::Tensor& x, const bf16* wp, int64_t P, int64_t K2, const bf16* b, int64_t N, Out out,
              bf16* yp, int64_t width) {
  const int64_t M = x.size(0), stride = K2 * kWidth * 2, per_panel = out == Out::kPlain ? kWidth : kHalf;
  const at::Tensor xf = widened(x);
  const float* xp = xf.data_ptr<float>();
  const int64_t ldx = xf.stride(0);
  kvgate::for_each_panel(P, M, kWideRows, M, wp, stride,
                         [&](int64_t p, int64_t r0, int rows, const kvgate::Ahead<bf16>& ahead) {
                           const int64_t c = p * per_panel, cols = std::min(per_panel, N - c);
                           const bf16* bp = b == nullptr ? nullptr : b + c;
                           const bf16* bu = b == nullptr || out == Out::kPlain ? nullptr : b + N + c;
                           bf16* y = yp + r0 * width + c;
                           wide_of(rows, out)(xp + r0 * ldx, ldx, wp + p * stride, K2, ahead, bp, bu, y,
                                              out == Out::kSplit ? y + N : nullptr, width, cols);
                         });
}
#endif

at::Tensor run_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                      int64_t out_features, Out out, const char* name) {
  TORCH_CHECK(built(), name, ": this build has neither AVX512-BF16 nor AVX2 (bf16_panels_built() is false)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.stride(1) == 1, name,
              ": x must be a 2-D bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kWidth && panels.size(3) == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16,
              name, ": panels must come from this build's pack_panels_bf16 ([P, K / 2, ", kWidth, ", 2])");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), K2 = panels.size(1), N = out_features;
  const int64_t per_panel = out == Out::kPlain ? kWidth : kHalf;
  TORCH_CHECK(K == 2 * K2, name, ": x has ", K, " features, the panels ", 2 * K2);
  TORCH_CHECK(N > (P - 1) * per_panel && N <= P * per_panel, name, ": ", P, " panels cannot hold ", N, " outputs");
  const int64_t bias_len = out == Out::kPlain ? N : 2 * N;
  const bf16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == bias_len && bias->is_contiguous() &&
                    bias->scalar_type() == at::kBFloat16, name, ": bias must be a contiguous bfloat16 [", bias_len, "]");
    b = reinterpret_cast<const bf16*>(bias->data_ptr());
  }
  const int64_t width = out == Out::kSplit ? 2 * N : N;
  at::Tensor y = at::empty({M, width}, x.options());
#if defined(__AVX512BF16__)
  if (M == 0) return y;
  const bf16* xp = reinterpret_cast<const bf16*>(x.data_ptr());
  const bf16* wp = reinterpret_cast<const bf16*>(panels.data_ptr());
  bf16* yp = reinterpret_cast<bf16*>(y.data_ptr());
  const int64_t ldx = x.stride(0), stride = K2 * kWidth * 2;
  const auto run = [&](auto panels_per_tile, int64_t p, int64_t r0, int rows, const kvgate::Ahead<bf16>& ahead) {
    constexpr int V = decltype(panels_per_tile)::value;
    const int64_t c0 = p * per_panel, cols = std::min<int64_t>(V * per_panel, N - c0);
    const bf16* bp = b == nullptr ? nullptr : b + c0;
    const bf16* bu = b == nullptr || out == Out::kPlain ? nullptr : b + N + c0;
    bf16* yr = yp + r0 * width + c0;
    tile_of<V>(rows, out)(xp + r0 * ldx, ldx, wp + p * stride, stride, K2, ahead, bp, bu, yr,
                          out == Out::kSplit ? yr + N : nullptr, width, cols);
  };
  kvgate::for_each_panel_pair(P, M, kRows, wp, stride, run);
#elif defined(KVGATE_BF16_WIDEN)
  if (M > 0)
    run_wide(x, reinterpret_cast<const bf16*>(panels.data_ptr()), P, K2, b, N, out,
             reinterpret_cast<bf16*>(y.data_ptr()), width);
#endif
  return y;
}

at::Tensor panel_linear_bf16(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                             int64_t out_features) {
  return run_panels(x, panels, bias, out_features, Out::kPlain, "panel_linear_bf16");
}

at::Tensor gated_panel_linear_bf16(const at::Tensor& x, const at::Tensor& panels,
                                   const std::optional<at::Tensor>& bias, int64_t intermediate, bool silu) {
  return run_panels(x, panels, bias, intermediate, silu ? Out::kSiluMul : Out::kSplit, "gated_panel_linear_bf16");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgate, m) {
  m.def("bf16_panels_built() -> bool", &built);
  m.def("pack_panels_bf16(Tensor weight, bool gated=False) -> Tensor");
  m.def("panel_linear_bf16(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("gated_panel_linear_bf16(Tensor x, Tensor panels, Tensor? bias, int intermediate, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgate, CPU, m) {
  m.impl("pack_panels_bf16", &pack_panels_bf16);
  m.impl("panel_linear_bf16", &panel_linear_bf16);
  m.impl("gated_panel_linear_bf16", &gated_panel_linear_bf16);
}
