// How both panel kernels (panel_gemm.cpp, panel_gemm_bf16.cpp) share out a layer between threads:
// units of two adjacent panels (the last one alone where P is odd), each over `parts` row ranges
// so that units x parts items fill every thread, each range walked in tiles of `tile_rows` rows.
// While a range is walked, its tiles prefetch the pair after next, each its own slice of it.
// Where a tile covers one panel (AVX2), `for_each_panel` shares out the panels and walks them
// once per block of rows that fits in the core's L2.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <unistd.h>

namespace kvgate {

// How many row ranges to split M into so that `units` x ranges work items share out evenly over
// `threads` (1 where the units alone do; at most 8).
inline int64_t row_parts(int64_t units, int64_t threads) {
  int64_t best = 1;
  double best_share = 0.0;
  for (int64_t parts = 1; parts <= 8; ++parts) {
    const int64_t items = units * parts;
    const double share = static_cast<double>(items) / (((items + threads - 1) / threads) * threads);
    if (share > best_share + 0.02) best = parts, best_share = share;
  }
  return best;
}

// What one tile prefetches: `tile` of `tiles` equal slices of the K rows of `panels` (null: none),
// one row every few steps of its own K loop. Spread over all the tiles of a range, the next pair
// streams in at the pace the range computes; all of it in the first tile would ask for it faster
// than one core can read memory and leave the later tiles with nothing in flight.
template <typename Elem>
struct Ahead {
  const Elem* panels = nullptr;
  int64_t tile = 0, tiles = 1;

  // rows [first, first + count) of K, one every `every` steps of a K loop
  struct Slice {
    int64_t first, count, every;
  };
  Slice slice(int64_t K) const {
    const int64_t per = (K + tiles - 1) / tiles, first = std::min(K, tile * per);
    const int64_t count = std::min(per, K - first);
    return {first, count, count > 0 ? std::max<int64_t>(1, K / count) : K + 1};
  }
};

// Every tile of P panels over M rows, in parallel: run(Two{}, p, r0, rows, ahead) for panels p and
// p + 1 over rows [r0, r0 + rows), run(One{}, ...) for a last odd panel. `ahead` names the panel
// pair after next (from `panels`, `stride` elements apart) and this tile's slice of it, to
// prefetch while the current pair stays in L2 (no panels where there is no such pair).
template <typename Elem, typename Run>
void for_each_panel_pair(int64_t P, int64_t M, int64_t tile_rows, const Elem* panels, int64_t stride, const Run& run) {
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  const int64_t units = (P + 1) / 2;
  const int64_t parts = std::min(row_parts(units, at::get_num_threads()), (M + tile_rows - 1) / tile_rows);
  const int64_t part_rows = ((M + parts - 1) / parts + tile_rows - 1) / tile_rows * tile_rows;
  at::parallel_for(0, units * parts, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t u = i / parts, m0 = (i % parts) * part_rows, m1 = std::min(M, m0 + part_rows);
      const int64_t p = 2 * u;
      const Elem* ahead = p + 4 < P && M >= tile_rows ? panels + (p + 4) * stride : nullptr;
      const int64_t tiles = (m1 - m0 + tile_rows - 1) / tile_rows;
      for (int64_t t = 0, r0 = m0; r0 < m1; ++t, r0 += tile_rows) {
        const int rows = static_cast<int>(std::min<int64_t>(tile_rows, m1 - r0));
        if (p + 1 < P)
          run(Two{}, p, r0, rows, Ahead<Elem>{ahead, t, tiles});
        else
          run(One{}, p, r0, rows, Ahead<Elem>{});
      }
    }
  });
}

// Rows per block for `for_each_panel`: as many x rows of `row_bytes` as fill half of the core's L2
// (the panel being multiplied and the one prefetched share the rest), a multiple of `tile_rows`,
// the blocks of M as equal as that allows.
inline int64_t row_block(int64_t M, int64_t row_bytes, int64_t tile_rows) {
  static const int64_t l2 = [] {
    const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return bytes > 0 ? static_cast<int64_t>(bytes) : int64_t{256} << 10;
  }();
  if (M <= 0) return tile_rows;
  const int64_t most = std::max(tile_rows, l2 / 2 / std::max<int64_t>(row_bytes, 1) / tile_rows * tile_rows);
  const int64_t blocks = (M + most - 1) / most;
  return ((M + blocks - 1) / blocks + tile_rows - 1) / tile_rows * tile_rows;
}

// Every tile of P single panels over M rows, in parallel: run(p, r0, rows, ahead) for panel p over
// rows [r0, r0 + rows). The panels are shared between threads; a thread walks its panels once per
// block of `block` rows (`row_block`: x's rows that fit in L2), so the tiles broadcast from rows
// in L2 and each panel is read once per block, rather than every panel reading all of x from L3
// or memory. In the first block the tiles over a panel prefetch the panel after next, each its
// slice (the weights come from memory then; later blocks find them in L3); a single row
// prefetches nothing.
template <typename Elem, typename Run>
void for_each_panel(int64_t P, int64_t M, int64_t tile_rows, int64_t block, const Elem* panels, int64_t stride,
                    const Run& run) {
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int64_t m1 = std::min(M, m0 + block), tiles = (m1 - m0 + tile_rows - 1) / tile_rows;
      for (int64_t p = p0; p < p1; ++p) {
        const Elem* ahead = m0 == 0 && M > 1 && p + 2 < P ? panels + (p + 2) * stride : nullptr;
        for (int64_t t = 0, r0 = m0; r0 < m1; ++t, r0 += tile_rows)
          run(p, r0, static_cast<int>(std::min<int64_t>(tile_rows, m1 - r0)), Ahead<Elem>{ahead, t, tiles});
      }
    }
  });
}

}  // namespace kvgate
