// Attention of prefill chunks (many query rows per sequence) over their paged context, on CPU:
// the rows of a prompt whose prefix was a cache hit, and whole cold prompts. q and the pool are
// float32 or bfloat16 and every sum is float32: bfloat16 q and pool multiply on `vdpbf16ps` where
// the build has AVX512-BF16 (tile_over_keys_dot), else a bfloat16 key tile is widened once into a
// float32 scratch that all the unit's row tiles read; a bfloat16 q gets bfloat16 rows back.
//
// PyTorch's flash attention needs the context gathered into a contiguous copy first and runs its
// small GEMMs well below the machine's matmul rate on these shapes (docs/engine.md). This kernel
// reads K/V where they lie in the pool and works on transposed scores, so the softmax needs no
// horizontal operation:
//
//   row tile  R query rows of one KV head: the rows of all G query heads that share it
//             (row j = token j / G, head j % G); R = 3 vectors of lanes (48 with AVX-512); a
//             tile with fewer rows computes only the vectors that hold some (12 rows: one)
//   Q^T  [D][R]     the tile's queries, scaled (and by log2(e): the softmax runs on 2^x), packed once
//   per tile of 64 keys, in order (online softmax):
//     S^T  [keys][R] = K . Q^T     each key's D values broadcast from the pool against Q^T's
//                                  vectors: KEYS x 3 accumulators, every lane a different row;
//                                  keys after a row's position masked (only where a key tile
//                                  reaches past the tile's first row) and the running max taken
//                                  on the accumulators, before they are stored
//     m, l per row as vectors: the max over keys is a vertical max, so are exp and the sums
//     O^T  [D][R] = O^T * alpha + V^T . P^T   each value broadcast against P^T's vectors, O^T
//                                  scaled by alpha as the accumulators load it
//   out[row] = O^T[:, row] / l[row]
//
// A unit of work is (span, KV head, `row_tiles` consecutive row tiles): each key tile is read
// from the pool once for all of them. Units are handed out longest first from a shared counter,
// so a causal prompt's short and long units even out between threads.
//
// Shapes (the layouts engine/attention.py has):
//   q          [T, H, D]      rows of span s are q_start[s] .. q_start[s+1]-1; any row stride
//   k/v cache  [NB, BS, KV, D]  a layer's view: any block stride, contiguous inside a block
//   tables     [S, W] int64   block ids of span s's context, in order (padded)
//   q_start    [S + 1] int64
//   ctx_lens   [S] int64      keys of span s; its last row sits at position ctx_len - 1
// Row i of span s (n rows) is at position ctx_len - n + i and attends to keys 0 ..= that position.
// Returns [T, H, D] in q's dtype. D must be a multiple of 8.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "paged_inputs.h"
#include "vec_math.h"

namespace {

constexpr int kLanes = kvgate::kWideLanes;  // rows per vector
#if defined(__AVX512F__)
constexpr int kKeys = 8;    // 8 keys x 3 vectors = 24 accumulators of 32 registers
#else
constexpr int kKeys = 4;    // 4 x 3 = 12 accumulators of 16 registers
#endif
constexpr int kVecs = 3;  // vectors of rows in a full row tile (tiles take 1 to kVecs: tile_over_keys)
constexpr int kRows = kVecs * kLanes;
constexpr int kTile = 64;   // keys per softmax tile; a multiple of kKeys
static_assert(kTile % kKeys == 0, "a tile holds whole key groups");

using vec = kvgate::f32xw;
using ivec = kvgate::i32xw;
constexpr auto load = kvgate::loadw;
constexpr auto store = kvgate::storew;
constexpr auto splat = kvgate::splatw;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// 2^x for the softmax: the queries carry log2(e) besides the model's scale, so scores are in log2
// units and 2^(s - max) is e^(true score - max). x is clamped at -125, where 2^x is still a normal
// float (a denormal would cost a microcode assist per vector on Intel CPUs); masked keys are
// zeroed by their callers. x = k + r with k = round(x), |r| <= 1/2, then 2^r by the degree-7
// Taylor polynomial of e^(r ln 2) (relative error < 6e-9, as vec_math.h's exp on its range) and
// 2^k put into the exponent: one vscalefps with AVX-512, else the integer add of vec_math.h's exp.
// Against that exp: no multiply by log2(e), no two-part ln 2 reduction, no upper clamp (x <= 0
// here), which with the fusions below makes a chunk's layer measurably faster (docs/engine.md).
inline vec exp2_vec(vec x) {
  const vec lo = splat(-125.0f);
  x = x < lo ? lo : x;
#if defined(__AVX512F__)
  const __m512 k = _mm512_roundscale_ps(reinterpret_cast<__m512>(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const vec r = x - reinterpret_cast<vec>(k);
#else
  const vec k = (x + 12582912.0f) - 12582912.0f;  // round to nearest: |x| < 2^22
  const vec r = x - k;
#endif
  vec p = splat(1.52527338e-05f);  // (ln 2)^n / n!, n = 7 .. 0
  p = p * r + 1.54035304e-04f;
  p = p * r + 1.33335581e-03f;
  p = p * r + 9.61812911e-03f;
  p = p * r + 5.55041087e-02f;
  p = p * r + 2.40226507e-01f;
  p = p * r + 6.93147181e-01f;
  p = p * r + 1.0f;
#if defined(__AVX512F__)
  return reinterpret_cast<vec>(_mm512_scalef_ps(reinterpret_cast<__m512>(p), k));
#else
  return kvgate::times_pow2<vec, ivec>(p, k);
#endif
}

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

using kvgate::bf16;
using kvgate::to_float;

// Rows of one KV head a unit computes: up to row_tiles tiles of kRows rows.
struct Unit {
  int64_t span, kv_head, row0, rows, keys;  // rows j in [row0, row0 + rows); keys: visible to the last row
};

// One tile of up to kRows query rows and its running softmax; `vecs` of its kVecs vectors of rows
// hold real rows (a tile of 12 rows computes one vector, not three).
struct RowTile {
  std::vector<float> qt, ot;  // Q^T [D][R] (scaled), O^T [D][R]
  std::vector<uint32_t> qt2;  // bfloat16 pairs: Q^T [D / 2][R] (unscaled; tile_over_keys_dot)
  vec m[kVecs], l[kVecs], pos[kVecs];
  int64_t first_pos = 0, keys = 0;  // position of its first row; keys its last row sees
  int vecs = kVecs;
};

// S^T[t][r] = sum_d K[t][d] Q^T[d][r] for the kKeys keys at `keys` (keys k0 .. k0 + kKeys - 1),
// the first V vectors of rows; with `masked`, scores of keys past a row's position become -inf.
// `mt` takes the running max.
template <int V, bool masked>
inline void score_group(const float* const* keys, const float* qt, int64_t D, float* s, int64_t k0,
                        const vec* pos, vec* mt) {
  vec acc[kKeys][V];
#pragma GCC unroll 8
  for (int u = 0; u < kKeys; ++u)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) acc[u][v] = vec{};
  for (int64_t d = 0; d < D; ++d) {
    vec b[V];
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) b[v] = load(qt + d * kRows + v * kLanes);
#pragma GCC unroll 8
    for (int u = 0; u < kKeys; ++u) {
      const vec a = splat(keys[u][d]);
#pragma GCC unroll 3
      for (int v = 0; v < V; ++v) acc[u][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < kKeys; ++u)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) {
      vec x = acc[u][v];
      if (masked) x = splat(static_cast<float>(k0 + u)) > pos[v] ? splat(kNegInf) : x;
      mt[v] = vmax(mt[v], x);
      store(s + u * kRows + v * kLanes, x);
    }
}

// O^T[d0 + u][r] = O^T[d0 + u][r] * alpha[r] + sum_t V[t][d0 + u] P^T[t][r] for u < kKeys, t < n,
// the first V vectors of rows (O^T taken as zero when `first`).
template <int V>
inline void weigh_group(const float* const* values, const float* p, int64_t n, int64_t d0, float* ot,
                        const vec* alpha, bool first) {
  vec acc[kKeys][V];
#pragma GCC unroll 8
  for (int u = 0; u < kKeys; ++u)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) acc[u][v] = first ? vec{} : load(ot + (d0 + u) * kRows + v * kLanes) * alpha[v];
  for (int64_t t = 0; t < n; ++t) {
    vec b[V];
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) b[v] = load(p + t * kRows + v * kLanes);
    const float* row = values[t] + d0;
#pragma GCC unroll 8
    for (int u = 0; u < kKeys; ++u) {
      const vec a = splat(row[u]);
#pragma GCC unroll 3
      for (int v = 0; v < V; ++v) acc[u][v] += a * b[v];
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < kKeys; ++u)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) store(ot + (d0 + u) * kRows + v * kLanes, acc[u][v]);
}

// Row tile `rt` (its first V vectors of rows) over the key tile at k0 whose first `padded` keys
// (whole key groups) are at krow/vrow: scores, online softmax, weighing. `st`: scratch S^T/P^T.
template <int V>
void tile_over_keys(RowTile& rt, const float* const* krow, const float* const* vrow, int64_t k0, int64_t padded,
                    int64_t D, float* st) {
  const bool masked = k0 + padded - 1 > rt.first_pos;  // some key lies after some row's position
  vec mt[V];
  for (int v = 0; v < V; ++v) mt[v] = rt.m[v];
  if (masked)
    for (int64_t i = 0; i < padded; i += kKeys)
      score_group<V, true>(krow + i, rt.qt.data(), D, st + i * kRows, k0 + i, rt.pos, mt);
  else
    for (int64_t i = 0; i < padded; i += kKeys)
      score_group<V, false>(krow + i, rt.qt.data(), D, st + i * kRows, k0 + i, rt.pos, mt);
  vec alpha[V];
  for (int v = 0; v < V; ++v) {
    alpha[v] = exp2_vec(rt.m[v] - mt[v]);  // the first tile: 2^(-inf) ~ 0, times l = 0; O^T starts at zero
    rt.m[v] = mt[v];
    vec sum{};
    if (masked)  // masked keys hold -inf: exactly zero weight
      for (int64_t i = 0; i < padded; ++i) {
        float* row = st + i * kRows + v * kLanes;
        const vec x = load(row);
        const vec p = x == splat(kNegInf) ? vec{} : exp2_vec(x - mt[v]);
        store(row, p);
        sum += p;
      }
    else
      for (int64_t i = 0; i < padded; ++i) {
        float* row = st + i * kRows + v * kLanes;
        const vec p = exp2_vec(load(row) - mt[v]);
        store(row, p);
        sum += p;
      }
    rt.l[v] = rt.l[v] * alpha[v] + sum;
  }
  for (int64_t d0 = 0; d0 < D; d0 += kKeys) weigh_group<V>(vrow, st, padded, d0, rt.ot.data(), alpha, k0 == 0);
}

#if defined(__AVX512BF16__)
// The same tile with bfloat16 q and pool on AVX512-BF16: `vdpbf16ps` adds two bfloat16 products
// per float32 lane, so the scores take pairs of features and the weighing pairs of keys, each
// half the loop of the float32 form. Q^T holds each row's features (unscaled: the scale goes on
// the float32 scores) as pairs, [D / 2][R] 32-bit lanes of (even, odd); the weights P^T are
// rounded to bfloat16 in pairs of keys, [keys / 2][R]; V^T as pairs of keys, [keys / 2][D]. Every
// sum is float32, as PyTorch's bfloat16 flash attention does with its two matmuls.
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

template <int V, bool masked>
inline void score_group_dot(const bf16* const* keys, const uint32_t* qt2, int64_t D, float* s, int64_t k0,
                            const vec* pos, vec* mt, vec scale) {
  __m512 acc[kKeys][V];
#pragma GCC unroll 8
  for (int u = 0; u < kKeys; ++u)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) acc[u][v] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < D / 2; ++d2) {
    __m512bh b[V];
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) b[v] = as_bh(_mm512_loadu_si512(qt2 + d2 * kRows + v * kLanes));
#pragma GCC unroll 8
    for (int u = 0; u < kKeys; ++u) {
      uint32_t pair;
      std::memcpy(&pair, keys[u] + 2 * d2, sizeof pair);
      const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int>(pair)));
#pragma GCC unroll 3
      for (int v = 0; v < V; ++v) acc[u][v] = _mm512_dpbf16_ps(acc[u][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < kKeys; ++u)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) {
      vec x = reinterpret_cast<vec>(acc[u][v]) * scale;
      if (masked) x = splat(static_cast<float>(k0 + u)) > pos[v] ? splat(kNegInf) : x;
      mt[v] = vmax(mt[v], x);
      store(s + u * kRows + v * kLanes, x);
    }
}

template <int V>
inline void weigh_group_dot(const uint32_t* vt2, const uint32_t* p2, int64_t n, int64_t D, int64_t d0, float* ot,
                            const vec* alpha, bool first) {
  __m512 acc[kKeys][V];
#pragma GCC unroll 8
  for (int u = 0; u < kKeys; ++u)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v)
      acc[u][v] = first ? _mm512_setzero_ps()
                        : reinterpret_cast<__m512>(load(ot + (d0 + u) * kRows + v * kLanes) * alpha[v]);
  for (int64_t t2 = 0; t2 < n / 2; ++t2) {
    __m512bh b[V];
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) b[v] = as_bh(_mm512_loadu_si512(p2 + t2 * kRows + v * kLanes));
    const uint32_t* row = vt2 + t2 * D + d0;
#pragma GCC unroll 8
    for (int u = 0; u < kKeys; ++u) {
      const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int>(row[u])));
#pragma GCC unroll 3
      for (int v = 0; v < V; ++v) acc[u][v] = _mm512_dpbf16_ps(acc[u][v], a, b[v]);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < kKeys; ++u)
#pragma GCC unroll 3
    for (int v = 0; v < V; ++v) store(ot + (d0 + u) * kRows + v * kLanes, reinterpret_cast<vec>(acc[u][v]));
}

// Two float32 vectors of weights (keys t and t + 1 of 16 rows) as one of bfloat16 pairs.
inline __m512i pair_bf16(vec p0, vec p1) {
  const __m512i lo = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(p0))));
  const __m512i hi = _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(reinterpret_cast<__m512>(p1))));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// tile_over_keys with the pairs above; `st`: scratch S^T (float32), `p2`: P^T pairs.
template <int V>
void tile_over_keys_dot(RowTile& rt, const bf16* const* krow, const uint32_t* vt2, int64_t k0, int64_t padded,
                        int64_t D, float scale, float* st, uint32_t* p2) {
  const bool masked = k0 + padded - 1 > rt.first_pos;
  vec mt[V];
  for (int v = 0; v < V; ++v) mt[v] = rt.m[v];
  if (masked)
    for (int64_t i = 0; i < padded; i += kKeys)
      score_group_dot<V, true>(krow + i, rt.qt2.data(), D, st + i * kRows, k0 + i, rt.pos, mt, splat(scale));
  else
    for (int64_t i = 0; i < padded; i += kKeys)
      score_group_dot<V, false>(krow + i, rt.qt2.data(), D, st + i * kRows, k0 + i, rt.pos, mt, splat(scale));
  vec alpha[V];
  for (int v = 0; v < V; ++v) {
    alpha[v] = exp2_vec(rt.m[v] - mt[v]);
    rt.m[v] = mt[v];
    vec sum{};
    for (int64_t i = 0; i < padded; i += 2) {  // padded is a multiple of kKeys: whole pairs
      const vec x0 = load(st + i * kRows + v * kLanes), x1 = load(st + (i + 1) * kRows + v * kLanes);
      const vec q0 = x0 == splat(kNegInf) ? vec{} : exp2_vec(x0 - mt[v]);
      const vec q1 = x1 == splat(kNegInf) ? vec{} : exp2_vec(x1 - mt[v]);
      sum += q0 + q1;
      _mm512_storeu_si512(p2 + (i / 2) * kRows + v * kLanes, pair_bf16(q0, q1));
    }
    rt.l[v] = rt.l[v] * alpha[v] + sum;
  }
  for (int64_t d0 = 0; d0 < D; d0 += kKeys) weigh_group_dot<V>(vt2, p2, padded, D, d0, rt.ot.data(), alpha, k0 == 0);
}
#endif

#if defined(__AVX512BF16__)
constexpr bool kDotBuilt = true;
#else
constexpr bool kDotBuilt = false;
#endif

// Elem: the pool's element type (float or bf16); Q: q's.
template <typename Elem, typename Q>
at::Tensor chunk_attention_of(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const kvgate::PagedInputs& in, double scale, int64_t row_tiles) {
  constexpr bool dot = kDotBuilt && std::is_same_v<Elem, bf16> && std::is_same_v<Q, bf16>;  // tile_over_keys_dot
  // otherwise a bfloat16 pool's key tiles go through a float32 scratch
  constexpr bool widen = !dot && !std::is_same_v<Elem, float>;
  const int64_t T = in.T, H = in.H, D = in.D, BS = in.BS, KV = in.KV, G = in.G, S = in.S, W = in.W;
  const int64_t *starts = in.starts, *lens = in.lens, *table = in.table;

  std::vector<Unit> units;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = starts[s + 1] - starts[s], ctx = lens[s];
    TORCH_CHECK(ctx <= (1 << 24), "span ", s, ": a context of ", ctx, " keys is past this kernel's 2^24 (positions are compared as float32)");
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t j = 0; j < n * G; j += row_tiles * kRows) {
        const int64_t rows = std::min<int64_t>(row_tiles * kRows, n * G - j);
        units.push_back({s, h, j, rows, ctx - n + (j + rows - 1) / G + 1});
      }
  }
  // longest first: a causal prompt's last rows see every key, its first rows few
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.keys > b.keys; });

  auto out = at::empty({T, H, D}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const Q* qp = static_cast<const Q*>(q.data_ptr());
  const int64_t q_row = q.stride(0);
  const Elem* kp = static_cast<const Elem*>(k_cache.data_ptr());
  const Elem* vp = static_cast<const Elem*>(v_cache.data_ptr());
  const int64_t block_stride = k_cache.stride(0);
  const float fscale = static_cast<float>(scale) * 1.44269504088896341f;  // log2(e): see exp2_vec
  const std::vector<float> zeros(D, 0.0f);
  const std::vector<Elem> zero_keys(D, Elem{});
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(units.size());

  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total)), 1, [&](int64_t, int64_t) {
    std::vector<RowTile> tiles(row_tiles);
    for (RowTile& rt : tiles) {
      rt.qt.resize(dot ? 0 : D * kRows);
      rt.qt2.resize(dot ? D / 2 * kRows : 0);
      rt.ot.resize(D * kRows);
    }
    std::vector<float> scores(kTile * kRows);  // S^T, then P^T, of one row tile and key tile
    std::vector<const float*> krow(kTile), vrow(kTile);
    std::vector<float> kwide(widen ? kTile * D : 0), vwide(widen ? kTile * D : 0);
    std::vector<const Elem*> keys_at(dot ? kTile : 0);  // dot: K rows where they lie
    std::vector<uint32_t> vt2(dot ? kTile / 2 * D : 0), p2(dot ? kTile / 2 * kRows : 0);  // V^T, P^T pairs
    for (int64_t u = next.fetch_add(1); u < total; u = next.fetch_add(1)) {
      const Unit& unit = units[u];
      const int64_t s = unit.span, h = unit.kv_head, n = starts[s + 1] - starts[s], ctx = lens[s];
      const int64_t first = ctx - n;  // position of the span's row 0
      const int64_t* blocks = table + s * W;
      // where key `key` of this span's head h lies in the K (or V) pool
      const auto key_offset = [&](int64_t key) { return blocks[key / BS] * block_stride + ((key % BS) * KV + h) * D; };
      const int64_t ntiles = (unit.rows + kRows - 1) / kRows;
      // Q^T, scaled; padding rows (past the unit's rows) are zero and take the last row's position
      for (int64_t t = 0; t < ntiles; ++t) {
        RowTile& rt = tiles[t];
        const int64_t row0 = unit.row0 + t * kRows, rows = std::min<int64_t>(kRows, unit.row0 + unit.rows - row0);
        float* qt = rt.qt.data();
        float pos[kRows];
        for (int64_t r = 0; r < kRows; ++r) {
          const int64_t j = row0 + std::min<int64_t>(r, rows - 1);
          pos[r] = static_cast<float>(first + j / G);
          const Q* src = qp + (starts[s] + j / G) * q_row + (h * G + j % G) * D;
          if constexpr (dot) {
            uint32_t* qt2 = rt.qt2.data();
            for (int64_t d2 = 0; d2 < D / 2; ++d2)
              qt2[d2 * kRows + r] = r >= rows ? 0u : src[2 * d2] | static_cast<uint32_t>(src[2 * d2 + 1]) << 16;
            continue;
          }
          if (r >= rows) {
            for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = 0.0f;
            continue;
          }
          for (int64_t d = 0; d < D; ++d) qt[d * kRows + r] = to_float(src[d]) * fscale;
        }
        rt.first_pos = first + row0 / G;
        rt.keys = first + (row0 + rows - 1) / G + 1;
        rt.vecs = static_cast<int>((rows + kLanes - 1) / kLanes);
        for (int v = 0; v < kVecs; ++v) {
          rt.m[v] = splat(kNegInf);
          rt.l[v] = vec{};
          rt.pos[v] = load(pos + v * kLanes);
        }
      }
      float* st = scores.data();
      for (int64_t k0 = 0; k0 < unit.keys; k0 += kTile) {
        const int64_t tile_end = std::min<int64_t>(k0 + kTile, unit.keys);
        // keys past the unit's last row read a zero row: a key group may run past them, masked
        for (int64_t i = 0; i < kTile; ++i) {
          const int64_t key = k0 + i;
          if constexpr (dot) {
            keys_at[i] = key < tile_end ? kp + key_offset(key) : zero_keys.data();
            if (i % 2 == 1) {  // V^T pairs of keys i - 1 and i
              const Elem* v0 = key - 1 < tile_end ? vp + key_offset(key - 1) : zero_keys.data();
              const Elem* v1 = key < tile_end ? vp + key_offset(key) : zero_keys.data();
              uint32_t* dst = vt2.data() + (i / 2) * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d) dst[d] = v0[d] | static_cast<uint32_t>(v1[d]) << 16;
            }
          } else if (key >= tile_end) {
            krow[i] = vrow[i] = zeros.data();
          } else if constexpr (widen) {
            const Elem* ks = kp + key_offset(key);
            const Elem* vs = vp + key_offset(key);
            float* kd = kwide.data() + i * D;
            float* vd = vwide.data() + i * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) {
              kd[d] = to_float(ks[d]);
              vd[d] = to_float(vs[d]);
            }
            krow[i] = kd;
            vrow[i] = vd;
          } else {
            krow[i] = kp + key_offset(key);
            vrow[i] = vp + key_offset(key);
          }
        }
        // the next key tile's K/V toward L2 while this one computes (a layer's K/V lie in small
        // pieces far apart in the pool, which the hardware prefetcher does not follow)
        for (int64_t key = tile_end; key < std::min(unit.keys, tile_end + kTile); ++key) {
          const int64_t offset = key_offset(key);
          for (int64_t d = 0; d < D; d += 64 / static_cast<int64_t>(sizeof(Elem))) {  // a cache line
            __builtin_prefetch(kp + offset + d, 0, 2);
            __builtin_prefetch(vp + offset + d, 0, 2);
          }
        }
        // every row tile of the unit over this key tile, while its K/V rows are in L1/L2
        for (int64_t t = 0; t < ntiles; ++t) {
          RowTile& rt = tiles[t];
          if (k0 >= rt.keys) continue;  // a causal tile that ends before these keys
          // whole key groups; keys past this tile's last row (real ones of a later row tile, or
          // zero rows) lie after every row's position, so the mask gives them weight 0
          const int64_t kt = std::min<int64_t>(tile_end, rt.keys) - k0;
          const int64_t padded = (kt + kKeys - 1) / kKeys * kKeys;
          static_assert(kVecs == 3, "the dispatch below spells out 1 to 3 vectors");
#if defined(__AVX512BF16__)
          if constexpr (dot) {
            const bf16* const* kr = reinterpret_cast<const bf16* const*>(keys_at.data());
            if (rt.vecs == 3)
              tile_over_keys_dot<3>(rt, kr, vt2.data(), k0, padded, D, fscale, st, p2.data());
            else if (rt.vecs == 2)
              tile_over_keys_dot<2>(rt, kr, vt2.data(), k0, padded, D, fscale, st, p2.data());
            else
              tile_over_keys_dot<1>(rt, kr, vt2.data(), k0, padded, D, fscale, st, p2.data());
            continue;
          }
#endif
          if (rt.vecs == 3)
            tile_over_keys<3>(rt, krow.data(), vrow.data(), k0, padded, D, st);
          else if (rt.vecs == 2)
            tile_over_keys<2>(rt, krow.data(), vrow.data(), k0, padded, D, st);
          else
            tile_over_keys<1>(rt, krow.data(), vrow.data(), k0, padded, D, st);
        }
      }
      for (int64_t t = 0; t < ntiles; ++t) {
        const RowTile& rt = tiles[t];
        const int64_t row0 = unit.row0 + t * kRows, rows = std::min<int64_t>(kRows, unit.row0 + unit.rows - row0);
        float inv[kRows];
        for (int v = 0; v < rt.vecs; ++v) store(inv + v * kLanes, splat(1.0f) / rt.l[v]);
        const float* ot = rt.ot.data();
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t j = row0 + r;
          float* dst = op + ((starts[s] + j / G) * H + h * G + j % G) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * kRows + r] * inv[r];
        }
      }
    }
  });
  return std::is_same_v<Q, float> ? out : out.to(q.scalar_type());
}

at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& tables, const at::Tensor& q_start, const at::Tensor& ctx_lens,
                           double scale, int64_t row_tiles) {
  const kvgate::PagedInputs in = kvgate::check_paged_inputs(q, k_cache, v_cache, tables, q_start, ctx_lens, true);
  TORCH_CHECK(row_tiles >= 1, "row_tiles must be positive");
  TORCH_CHECK(in.D % kKeys == 0 && in.D % 8 == 0, "head size must be a multiple of 8");
  return kvgate::by_element_types(q, k_cache, [&](auto elem, auto q_elem) {
    return chunk_attention_of<decltype(elem), decltype(q_elem)>(q, k_cache, v_cache, in, scale, row_tiles);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgate, m) {
  m.def("chunk_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor q_start, "
        "Tensor ctx_lens, float scale, int row_tiles) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgate, CPU, m) { m.impl("chunk_attention", &chunk_attention); }
