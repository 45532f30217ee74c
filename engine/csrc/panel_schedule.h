// How both panel kernels (panel_gemm.cpp, panel_gemm_bf16.cpp) share out a layer between threads:
// units of two adjacent panels (the last one alone where P is odd), each over `parts` row ranges
// so that units x parts items fill every thread, each range walked in tiles of `tile_rows` rows.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

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

// Calls tile(p, r0, rows, first, pair) for every tile of P panels over M rows, in parallel: panel
// p (and p + 1 where `pair`) over rows [r0, r0 + rows); `first` for the first tile of a range,
// which is the one that prefetches the unit after next.
template <typename Tile>
void for_each_panel_pair(int64_t P, int64_t M, int64_t tile_rows, const Tile& tile) {
  const int64_t units = (P + 1) / 2;
  const int64_t parts = std::min(row_parts(units, at::get_num_threads()), (M + tile_rows - 1) / tile_rows);
  const int64_t part_rows = ((M + parts - 1) / parts + tile_rows - 1) / tile_rows * tile_rows;
  at::parallel_for(0, units * parts, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t u = i / parts, m0 = (i % parts) * part_rows, m1 = std::min(M, m0 + part_rows);
      const int64_t p = 2 * u;
      for (int64_t r0 = m0; r0 < m1; r0 += tile_rows)
        tile(p, r0, static_cast<int>(std::min<int64_t>(tile_rows, m1 - r0)), r0 == m0, p + 1 < P);
    }
  });
}

}  // namespace kvgate
