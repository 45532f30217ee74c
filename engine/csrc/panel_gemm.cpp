// y = x W^T + b on CPU, float32, for any number of rows: the matmul of every packed linear layer
// once the native kernels are in (engine/packing.py). The panels are the layer's only copy of its
// weight, so this kernel takes every row count, decode steps and prompt chunks alike.
//
// With few rows a forward pass streams every weight from memory once and uses it for at most
// tens of rows, so how the weights arrive matters as much as the multiply; with many rows the
// multiply dominates. W is repacked once into panels of `kWidth` output columns, each panel
// [K][kWidth] contiguous, so a panel is one sequential stream, and a tile covers two adjacent
// panels (where the build has 32 vector registers):
//
//   for each pair of panels (pairs shared between threads; row ranges too, where pairs alone
//   would leave a thread idle):
//     for each block of up to kWideRows rows:       kWideRows x 4 vector accumulators
//       for k in 0..K:  four vectors of the panels' row k, each x[r][k] broadcast against all
//
// Four weight loads and kWideRows broadcasts feed 4 x kWideRows FMAs: the blocking oneDNN's own
// float32 kernels use. The pair (K x 2 kWidth x 4 bytes) stays in L2 while every row block passes
// over it; with a full row block, the row blocks prefetch the pair after next, each its slice of
// it (panel_schedule.h `Ahead`), so its stream is in flight, at the pace the blocks compute,
// before the kernel reaches it. With 16 vector registers (AVX2), or a layer of one panel, a tile
// covers one panel with kMaxRows x 2 accumulators, and the tiles over a panel prefetch the panel
// after next in slices the same way (a single row prefetches nothing); there a thread walks its
// panels once per block of rows that fits in L2 (panel_schedule.h `for_each_panel`).
//
// Shapes: x [M, K] (any row stride, unit column stride); panels [P, K, kWidth] from
// `pack_panels` (columns past N zero); bias [N] or none. Returns [M, N].
//
// A gated MLP's gate|up weight [2 I, K] packed with `pack_panels(w, gated=true)` pairs gate output
// i with up output i in one panel (first vector gate, second up), so `gated_panel_linear` can
// write SiLU(gate) * up [M, I] from the accumulators, or gate | up [M, 2 I] as the plain matmul
// would. Those panels only make sense to `gated_panel_linear` (the shapes cannot tell them apart).
// Panels unpack to W with a permute and a reshape (engine/packing.py `unpack_panels`).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "panel_schedule.h"
#include "vec_math.h"

namespace {

constexpr int kLanes = kvgate::kWideLanes;
#if defined(__AVX512F__)
constexpr int kMaxRows = 14;  // 14 x 2 = 28 accumulators of 32 zmm registers
constexpr int kWideRows = 6;  // 6 x 4 = 24 accumulators, the fastest of 5 to 7 rows
constexpr bool kTwoPanels = true;
#else
constexpr int kMaxRows = 6;   // 6 x 2 = 12 accumulators of 16 ymm registers
constexpr int kWideRows = 1;  // unused: 16 registers leave no room for a two-panel tile
constexpr bool kTwoPanels = false;
#endif
constexpr int kWidth = 2 * kLanes;  // output columns per panel

using vec = kvgate::f32xw;
constexpr auto load = kvgate::loadw;
constexpr auto store = kvgate::storew;
constexpr auto splat = kvgate::splatw;

// What a tile writes: its 2 x kLanes outputs per panel as they are (kPlain); from a gated layer's
// panel (`pack_panels(w, gated=true)`: kLanes gate outputs, then the kLanes up outputs they pair
// with) the gate half to y and the up half to y_up (kSplit), or SiLU(gate) * up to y (kSiluMul).
enum class Out { kPlain, kSplit, kSiluMul };

// The outputs of the R rows at x for V adjacent panels (the second `next` floats after the first);
// `cols`: valid outputs over the V panels (of kWidth per panel for kPlain, of kLanes per half
// otherwise); bias (bias_up: of the up halves) or null; `ahead`: what to prefetch (no panels: nothing).
// acc += the R rows at x times V adjacent panels over K; with kAhead, prefetching `ahead`'s slice
// of its panels as it goes (a separate loop: the test would sit in the inner loop otherwise).
template <int R, int V, bool kAhead>
inline __attribute__((always_inline)) void accumulate(vec (&acc)[R][2 * V], const float* x, int64_t ldx,
                                                      const float* panel, int64_t next, int64_t K,
                                                      const kvgate::Ahead<float>& ahead) {
  const auto slice = kAhead ? ahead.slice(K) : kvgate::Ahead<float>::Slice{0, 0, 1};
  const float* pre = kAhead ? ahead.panels + slice.first * kWidth : nullptr;
  int64_t left = slice.count, due = 1;
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kWidth;
    vec b[2 * V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      b[2 * v] = load(w + v * next);
      b[2 * v + 1] = load(w + v * next + kLanes);
    }
    if constexpr (kAhead)
      if (--due == 0 && left > 0) {
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v)
#pragma GCC unroll 2
          for (int i = 0; i < kWidth; i += 16) __builtin_prefetch(pre + v * next + i, 0, 3);
        pre += kWidth, --left, due = slice.every;
      }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vec a = splat(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < 2 * V; ++j) acc[r][j] += a * b[j];
    }
  }
}

template <int R, int V, Out out>
void tile(const float* x, int64_t ldx, const float* panel, int64_t next, int64_t K, const kvgate::Ahead<float>& ahead,
          const float* bias, const float* bias_up, float* y, float* y_up, int64_t ldy, int64_t cols) {
  constexpr int64_t per_panel = out == Out::kPlain ? kWidth : kLanes;  // outputs of one panel
  vec acc[R][2 * V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 2 * V; ++j) acc[r][j] = vec{};
  if (ahead.panels != nullptr)
    accumulate<R, V, true>(acc, x, ldx, panel, next, K, ahead);
  else
    accumulate<R, V, false>(acc, x, ldx, panel, next, K, ahead);
  float row[kWidth];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t c = v * per_panel, n = std::min(per_panel, cols - c);
      store(row, acc[r][2 * v]);
      store(row + kLanes, acc[r][2 * v + 1]);
      if (out == Out::kPlain) {
        if (bias != nullptr)
          for (int64_t j = 0; j < n; ++j) row[j] += bias[c + j];
        std::memcpy(y + r * ldy + c, row, n * sizeof(float));
        continue;
      }
      if (bias != nullptr)
        for (int64_t j = 0; j < n; ++j) {
          row[j] += bias[c + j];
          row[kLanes + j] += bias_up[c + j];
        }
      if (out == Out::kSplit) {
        std::memcpy(y + r * ldy + c, row, n * sizeof(float));
        std::memcpy(y_up + r * ldy + c, row + kLanes, n * sizeof(float));
      } else {
        store(row, kvgate::silu_mul_lanes<vec, kvgate::i32xw>(load(row), load(row + kLanes)));
        std::memcpy(y + r * ldy + c, row, n * sizeof(float));
      }
    }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const kvgate::Ahead<float>&,
                        const float*, const float*, float*, float*, int64_t, int64_t);

template <int V, Out out, int... Rs>
constexpr TileFn tile_for(int rows, std::integer_sequence<int, Rs...>) {
  constexpr TileFn tiles[] = {&tile<Rs + 1, V, out>...};
  return tiles[rows - 1];
}

// The tile of `rows` rows (1 to kMaxRows for one panel, to kWideRows for two) writing `out`.
template <int V>
TileFn tile_of(int rows, Out out) {
  constexpr int most = V == 1 ? kMaxRows : kWideRows;
  const auto sizes = std::make_integer_sequence<int, most>{};
  return out == Out::kPlain ? tile_for<V, Out::kPlain>(rows, sizes)
         : out == Out::kSplit ? tile_for<V, Out::kSplit>(rows, sizes)
                              : tile_for<V, Out::kSiluMul>(rows, sizes);
}

// Panels of `weight` [N, K]: panel p holds outputs p * kWidth ... (columns past N zero). `gated`:
// the weight is a gated MLP's gate rows over its up rows ([2 I, K]), and panel p holds gate outputs
// p * kLanes ... then the up outputs of the same indices, so one tile has both halves of each.
at::Tensor pack_panels(const at::Tensor& weight, bool gated) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_panels takes a 2-D float32 CPU weight [out_features, in_features]");
  TORCH_CHECK(!gated || weight.size(0) % 2 == 0, "pack_panels: a gated weight stacks gate and up rows (",
              weight.size(0), " rows is odd)");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), half = N / 2;
  const int64_t P = gated ? (half + kLanes - 1) / kLanes : (N + kWidth - 1) / kWidth;
  at::Tensor out = at::zeros({P, K, kWidth}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  // the weight row behind column j of panel p, or -1 for a zero column
  const auto source_row = [&](int64_t p, int64_t j) -> int64_t {
    if (!gated) return p * kWidth + j < N ? p * kWidth + j : -1;
    const int64_t i = p * kLanes + j % kLanes;
    return i < half ? (j < kLanes ? i : half + i) : -1;
  };
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kWidth; ++j) {
        const int64_t n = source_row(p, j);
        if (n < 0) continue;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kWidth + j] = src[n * K + k];
      }
  });
  return out;
}

// x [M, K] times panels; `out`: what the tiles write (a gated layer's halves split into [M, 2 I]
// for kSplit, SiLU(gate) * up [M, I] for kSiluMul). out_features: N (kPlain) or I.
at::Tensor run_panels(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                      int64_t out_features, Out out, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              name, ": x must be a 2-D float32 CPU tensor with contiguous rows");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kWidth && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat,
              name, ": panels must come from this build's pack_panels ([P, K, ", kWidth, "])");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = out_features;
  const int64_t per_panel = out == Out::kPlain ? kWidth : kLanes;  // outputs per panel
  TORCH_CHECK(panels.size(1) == K, name, ": x has ", K, " features, the panels ", panels.size(1));
  TORCH_CHECK(N > (P - 1) * per_panel && N <= P * per_panel, name, ": ", P, " panels cannot hold ", N, " outputs");
  const int64_t bias_len = out == Out::kPlain ? N : 2 * N;
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == bias_len && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                name, ": bias must be a contiguous float32 [", bias_len, "]");
    b = bias->data_ptr<float>();
  }
  const int64_t width = out == Out::kSplit ? 2 * N : N;  // y's columns
  at::Tensor y = at::empty({M, width}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), stride = K * kWidth;
  // the tile of V panels from panel p over rows [r0, r0 + rows); `ahead`: what it prefetches
  const auto run = [&](auto panels_per_tile, int64_t p, int64_t r0, int rows, const kvgate::Ahead<float>& ahead) {
    constexpr int V = decltype(panels_per_tile)::value;
    const int64_t c0 = p * per_panel, cols = std::min<int64_t>(V * per_panel, N - c0);
    const float* bp = b == nullptr ? nullptr : b + c0;
    const float* bu = b == nullptr || out == Out::kPlain ? nullptr : b + N + c0;
    float* yr = yp + r0 * width + c0;
    tile_of<V>(rows, out)(xp + r0 * ldx, ldx, wp + p * stride, stride, K, ahead, bp, bu, yr,
                          out == Out::kSplit ? yr + N : nullptr, width, cols);
  };
  using One = std::integral_constant<int, 1>;
  if (!kTwoPanels || P < 2) {
    // Each tile of a panel prefetches its slice of the panel after next, as the pair tiles do
    // (all of it in the first tile left the later ones waiting on memory). A single row streams
    // faster on the hardware prefetchers alone (docs/engine.md).
    const int64_t block = kvgate::row_block(M, K * static_cast<int64_t>(sizeof(float)), kMaxRows);
    kvgate::for_each_panel(P, M, kMaxRows, block, wp, stride,
                           [&](int64_t p, int64_t r0, int rows, const kvgate::Ahead<float>& ahead) {
                             run(One{}, p, r0, rows, ahead);
                           });
    return y;
  }
  kvgate::for_each_panel_pair(P, M, kWideRows, wp, stride, run);
  return y;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  return run_panels(x, panels, bias, out_features, Out::kPlain, "panel_linear");
}

// A gated MLP's gate and up projections from `pack_panels(w, gated=true)` panels: with `silu`,
// SiLU(gate) * up [M, intermediate] (the activation in the matmul's epilogue: no [M, 2 I]
// intermediate written and read back), else gate | up [M, 2 intermediate] as x w^T would give.
at::Tensor gated_panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                              int64_t intermediate, bool silu) {
  return run_panels(x, panels, bias, intermediate, silu ? Out::kSiluMul : Out::kSplit, "gated_panel_linear");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgate, m) {
  m.def("pack_panels(Tensor weight, bool gated=False) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
  m.def("gated_panel_linear(Tensor x, Tensor panels, Tensor? bias, int intermediate, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgate, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
  m.impl("gated_panel_linear", &gated_panel_linear);
}
