// y = x W^T + b on CPU in bfloat16, float32 sums, for any number of rows: the bfloat16 form of
// panel_gemm.cpp, on CPUs with AVX512-BF16 (`vdpbf16ps`: each float32 lane adds two bfloat16
// products, so a vector of weights covers 16 outputs at two input features).
//
// W [N, K] is repacked once into panels of kWidth = 32 outputs, each [K / 2][32][2]: for every
// pair of input features, the 32 outputs' two weights side by side, so one panel is one
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
// Shapes: x [M, K] bfloat16 (any row stride, unit column stride), K even; panels [P, K / 2, 32, 2]
// bfloat16 from `pack_panels_bf16`; bias [N] (gated: [2 I]) bfloat16 or none. Without AVX512-BF16
// in the build the ops raise, and `bf16_panels_built()` says false.

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
#include <immintrin.h>

#include "panel_schedule.h"
#endif

namespace {

using kvgate::bf16;
constexpr int kWidth = 32;  // outputs per panel
constexpr int kHalf = 16;   // outputs per vector


enum class Out { kPlain, kSplit, kSiluMul };

bool built() {
#if defined(__AVX512BF16__)
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

// Panels [P, K / 2, 32, 2] of `weight` [N, K] (outputs past N zero); `gated`: panel p holds gate
// outputs p * 16 ... then the up outputs of the same indices.
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

inline __mmask16 first(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

// One row's outputs of a panel from its two accumulators: 32 plain outputs (`lo` the first 16),
// or 16 gated ones (`lo` the gates, `hi` the ups); `cols` of them valid.
template <Out out>
inline void write_row(__m512 lo, __m512 hi, const bf16* bias, const bf16* bias_up, bf16* y, bf16* y_up,
                      int64_t cols) {
  if (out == Out::kPlain) {
    const __mmask16 m0 = first(cols), m1 = first(cols - 16);
    store_bf16(y, _mm512_add_ps(lo, load_bf16(bias, m0)), m0);
    if (cols > 16) store_bf16(y + 16, _mm512_add_ps(hi, load_bf16(bias ? bias + 16 : nullptr, m1)), m1);
    return;
  }
  const __mmask16 m = first(cols);
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

at::Tensor run_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                      int64_t out_features, Out out, const char* name) {
  TORCH_CHECK(built(), name, ": this build has no AVX512-BF16 (bf16_panels_built() is false)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.stride(1) == 1, name,
              ": x must be a 2-D bfloat16 CPU tensor with contiguous rows");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kWidth && panels.size(3) == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kBFloat16,
              name, ": panels must come from pack_panels_bf16 ([P, K / 2, 32, 2])");
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
