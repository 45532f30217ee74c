// Paged attention for few query rows per sequence (decodes, short prefill chunks) on CPU.
//
// A unit of work is one split of a sequence's context (`split_tokens` keys, fewer when there are
// not enough splits to keep every core busy) for all of its rows and heads. A float32 split is
// read where it lies in the block pool, a bfloat16 one copied out first unless it multiplies on
// `vdpbf16ps` (below). Each K/V row is loaded once for the query heads that share its KV head
// (GQA, up to three at a time). Each split keeps its own softmax max, sum and weighted values,
// merged at the end (the usual log-sum-exp combination). Units go to whichever thread is free
// first (claim.h); while there are enough, a thread also holds the unit it takes next and
// prefetches its K/V rows as it works (NextRows).
//
// Shapes (float32 or bfloat16 q and pool, computed in float32; the layouts engine/attention.py has):
//   q          [T, H, D]                 heads contiguous, any row stride; rows of span s are
//                                        q_start[s] .. q_start[s+1]-1
//   k/v cache  [NB, BS, KV, D]           a layer's view: any block stride, contiguous inside a block
//   tables     [S, W] int64              block ids of span s's context, in order (padded)
//   q_start    [S + 1] int64
//   ctx_lens   [S] int64                 keys of span s; its last row sits at position ctx_len - 1
// Row i of span s (n rows) is at position ctx_len - n + i and attends to keys 0 ..= that position.
// Returns [T, H, D].

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "claim.h"
#include "paged_inputs.h"
#include "vec_math.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The pool holds float32 or bfloat16 K/V; either is read as float32 and every sum is float32.
using kvgate::bf16;
using kvgate::to_float;
using kvgate::narrow;

// exp of scores shifted by their max (<= 0; -inf for masked keys, whose weight is 0).
inline void exp_nonpositive(float* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = (x[i] == kNegInf) ? 0.0f : kvgate::exp_clamped(x[i]);
}

// row[t] = q . keys[t] for t < n (generic loop, any head size).
template <typename KV>
inline void score_row_generic(const float* q, const KV* const* keys, int64_t n, int64_t d, float* row) {
  for (int64_t t = 0; t < n; ++t) {
    const KV* k = keys[t];
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; ++i) acc += q[i] * to_float(k[i]);
    row[t] = acc;
  }
}

// out = sum_t p[t] * values[t] for t < n (out is overwritten; generic loop, any head size).
template <typename KV>
inline void weigh_values_generic(const float* p, const KV* const* values, int64_t n, int64_t d, float* out) {
  std::fill(out, out + d, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const KV* v = values[t];
    const float w = p[t];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] += w * to_float(v[i]);
  }
}

// The K/V rows of the unit a thread takes next, prefetched (into L2) a few lines at a time while
// it works on the current one. A split's rows lie in blocks far apart in the pool: read on
// demand, each block's first lines wait on memory; spread over the current unit's loops, the
// next unit's stream in at the pace the work goes.
struct NextRows {
  struct Run {
    const char* k;
    const char* v;
    int64_t lines;
  };
  std::vector<Run> runs;
  size_t run = 0;
  int64_t line = 0, per_step = 0;

  void clear() { runs.clear(), run = 0, line = 0, per_step = 0; }
  void add(const void* k, const void* v, int64_t bytes) {
    runs.push_back({static_cast<const char*>(k), static_cast<const char*>(v), (bytes + 63) / 64});
  }
  // spread the runs' lines over `steps` calls of step()
  void pace(int64_t steps) {
    int64_t lines = 0;
    for (const Run& r : runs) lines += r.lines;
    per_step = steps > 0 ? (lines + steps - 1) / steps : lines;
  }
  inline void step() {
    for (int64_t c = per_step; c > 0 && run < runs.size(); --c) {
      const Run& r = runs[run];
      __builtin_prefetch(r.k + 64 * line, 0, 2);  // locality 2: prefetcht1 on x86 (into L2)
      __builtin_prefetch(r.v + 64 * line, 0, 2);
      if (++line == r.lines) ++run, line = 0;
    }
  }
};

#if defined(__AVX512VL__)
constexpr int kMaxGroup = 3;  // 3 x 8 accumulators in the 32 vector registers AVX-512 gives
#else
constexpr int kMaxGroup = 1;  // 16 registers: one query at a time
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Head size 64 with AVX2: eight keys scored at once (eight accumulators per query, one
// horizontal reduction per eight keys); a query's 64 weighted values held in eight registers.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  const __m256 b2 = _mm256_hadd_ps(a4, a5), b3 = _mm256_hadd_ps(a6, a7);
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
  // c0 = [k0 k1 k2 k3 | k0 k1 k2 k3] halves, c1 likewise for k4..k7
  const __m256 lo = _mm256_permute2f128_ps(c0, c1, 0x20), hi = _mm256_permute2f128_ps(c0, c1, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Eight elements of a K/V row as float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Scores of B queries (pointers q[b], already scaled, head size 64) against eight keys at once:
// each K row is loaded once for all B queries; rows[b][t .. t+8) receive them.
template <int B, typename KV>
inline void score_keys8_64(const float* const* q, const KV* const* keys, float* const* rows, int64_t t) {
  __m256 acc[B][8];
  for (int b = 0; b < B; ++b)
    for (int k = 0; k < 8; ++k) acc[b][k] = _mm256_setzero_ps();
  for (int c = 0; c < 8; ++c) {
    __m256 qv[B];
    for (int b = 0; b < B; ++b) qv[b] = _mm256_loadu_ps(q[b] + c * 8);
    for (int k = 0; k < 8; ++k) {
      const __m256 kv = load8(keys[k] + c * 8);
      for (int b = 0; b < B; ++b) acc[b][k] = _mm256_fmadd_ps(qv[b], kv, acc[b][k]);
    }
  }
  for (int b = 0; b < B; ++b)
    _mm256_storeu_ps(rows[b] + t, hsum8(acc[b][0], acc[b][1], acc[b][2], acc[b][3], acc[b][4], acc[b][5],
                                        acc[b][6], acc[b][7]));
}

// out[b] = sum_t p[b][t] * V row t (head size 64) for t < n: each V row loaded once for all B.
template <int B, typename KV>
inline void weigh_group_64(const float* const* p, const KV* base, const int64_t* offsets, int64_t n,
                           float* const* out, NextRows& next) {
  __m256 acc[B][8];
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < 8; ++c) acc[b][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    next.step();
    const KV* v = base + offsets[t];
    __m256 w[B];
    for (int b = 0; b < B; ++b) w[b] = _mm256_set1_ps(p[b][t]);
    for (int c = 0; c < 8; ++c) {
      const __m256 vv = load8(v + c * 8);
      for (int b = 0; b < B; ++b) acc[b][c] = _mm256_fmadd_ps(w[b], vv, acc[b][c]);
    }
  }
  for (int b = 0; b < B; ++b)
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out[b] + c * 8, acc[b][c]);
}

template <int B, typename KV>
inline void score_group_64(const float* const* q, const KV* base, const int64_t* offsets, int64_t n,
                           float* const* rows, NextRows& next) {
  const KV* keys[8];
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    next.step();
    for (int k = 0; k < 8; ++k) keys[k] = base + offsets[t + k];
    score_keys8_64<B>(q, keys, rows, t);
  }
  for (; t < n; ++t) {
    keys[0] = base + offsets[t];
    for (int b = 0; b < B; ++b) score_row_generic(q[b], keys, 1, 64, rows[b] + t);
  }
}
#endif

#if defined(__AVX512BF16__)
// bfloat16 q and pool, head size 64, on AVX512-BF16 (`vdpbf16ps`: two bfloat16 products added
// into each float32 lane). Scores: a K row is two vectors of 32 bfloat16, each multiplied with
// the query's half into one accumulator per key; 16 keys' accumulators are summed across lanes
// together (`sum16`). Values: two keys' V rows interleaved (16-bit unpacks) and multiplied by the
// pair's weights, which are rounded to bfloat16 as PyTorch's bfloat16 attention rounds them. The
// query is the unscaled bfloat16 one (the scale goes on the float32 scores): every product is
// exact and every sum float32.
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
inline __m512i load32(const bf16* p) { return _mm512_loadu_si512(p); }

// r[k] = the sum of v[k / 4 + 4 * (k % 4)]'s lanes: a transposing tree (pairs of 128-bit lanes,
// then 128-bit lanes, then 64- and 32-bit halves), 15 shuffle pairs and adds for 16 sums. Key k's
// accumulator goes to v[slot16(k)] for the sums to come out in key order.
constexpr int slot16(int k) { return k / 4 + 4 * (k % 4); }
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  __m512 y[2];
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// rows[b][t] = scale * (q[b] . K row t) for t < n, q[b] 64 bfloat16.
inline void score_group_dot(const bf16* const* q, int group, const bf16* base, const int64_t* offsets, int64_t n,
                            float scale, float* const* rows, NextRows& next) {
  for (int b = 0; b < group; ++b) {
    const __m512bh qlo = as_bh(load32(q[b])), qhi = as_bh(load32(q[b] + 32));
    for (int64_t t = 0; t < n; t += 16) {
      if (b == 0) next.step();
      const int keys = static_cast<int>(std::min<int64_t>(16, n - t));
      __m512 acc[16];
#pragma GCC unroll 16
      for (int k = 0; k < 16; ++k) {
        __m512 a = _mm512_setzero_ps();
        if (k < keys) {
          const bf16* kr = base + offsets[t + k];
          a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a, as_bh(load32(kr)), qlo), as_bh(load32(kr + 32)), qhi);
        }
        acc[slot16(k)] = a;
      }
      const __m512 r = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(rows[b] + t, kvgate::first_lanes(keys), r);
    }
  }
}

// out[b] = sum_t p[b][t] * V row t for t < n (head size 64); `pairs`: scratch for the weights as
// bfloat16 pairs.
inline void weigh_group_dot(const float* const* p, int group, const bf16* base, const int64_t* offsets, int64_t n,
                            float* const* out, std::vector<uint32_t>& pairs, NextRows& next) {
  const int64_t stride = (n + 31) / 32 * 16;  // whole vectors of pairs per query
  pairs.resize(static_cast<size_t>(kMaxGroup * stride));
  for (int b = 0; b < group; ++b) {
    uint32_t* pb = pairs.data() + b * stride;
    for (int64_t t = 0; t < n; t += 32) {  // 32 weights -> 16 pairs (an odd last key pairs with 0)
      const int64_t m = std::min<int64_t>(32, n - t);
      const __m512 lo = _mm512_maskz_loadu_ps(kvgate::first_lanes(m), p[b] + t);
      const __m512 hi = m > 16 ? _mm512_maskz_loadu_ps(kvgate::first_lanes(m - 16), p[b] + t + 16) : _mm512_setzero_ps();
      // cvtne2ps_pbh(hi, lo): lo's 16 weights in the low half, in key order: pairs as they come
      _mm512_storeu_si512(pb + t / 2, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
  __m512 acc[kMaxGroup][4];
  for (int b = 0; b < group; ++b)
    for (int c = 0; c < 4; ++c) acc[b][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 2) {
    next.step();
    const bf16* a = base + offsets[t];
    const bf16* z = t + 1 < n ? base + offsets[t + 1] : a;  // its weight is 0
    const __m512i alo = load32(a), ahi = load32(a + 32), zlo = load32(z), zhi = load32(z + 32);
    // within each 128-bit lane l: features 8l..8l+3 of the two rows side by side, then 8l+4..8l+7
    const __m512bh v[4] = {as_bh(_mm512_unpacklo_epi16(alo, zlo)), as_bh(_mm512_unpackhi_epi16(alo, zlo)),
                           as_bh(_mm512_unpacklo_epi16(ahi, zhi)), as_bh(_mm512_unpackhi_epi16(ahi, zhi))};
    for (int b = 0; b < group; ++b) {
      const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(pairs[b * stride + t / 2])));
      for (int c = 0; c < 4; ++c) acc[b][c] = _mm512_dpbf16_ps(acc[b][c], v[c], w);
    }
  }
  // back to feature order: lane 4l + k of acc[0] is feature 8l + k, of acc[1] feature 8l + 4 + k
  const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i order_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int b = 0; b < group; ++b)
    for (int h = 0; h < 2; ++h) {
      _mm512_storeu_ps(out[b] + 32 * h, _mm512_permutex2var_ps(acc[b][2 * h], order, acc[b][2 * h + 1]));
      _mm512_storeu_ps(out[b] + 32 * h + 16, _mm512_permutex2var_ps(acc[b][2 * h], order_hi, acc[b][2 * h + 1]));
    }
}
#endif

// Scores of a group of queries sharing a KV head against `n` keys (K rows at base + offsets[t]),
// into rows[b][0 .. n).
template <typename KV>
inline void score_group(const float* const* q, int group, const KV* base, const int64_t* offsets, int64_t n,
                        int64_t d, float* const* rows, std::vector<const KV*>& ptrs, NextRows& next) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d == 64) {
    if constexpr (kMaxGroup >= 3) {
      if (group == 3) return score_group_64<3>(q, base, offsets, n, rows, next);
      if (group == 2) return score_group_64<2>(q, base, offsets, n, rows, next);
    }
    return score_group_64<1>(q, base, offsets, n, rows, next);
  }
#endif
  ptrs.resize(n);
  for (int64_t t = 0; t < n; ++t) ptrs[t] = base + offsets[t], next.step();
  for (int b = 0; b < group; ++b) score_row_generic(q[b], ptrs.data(), n, d, rows[b]);
}

template <typename KV>
inline void weigh_group(const float* const* p, int group, const KV* base, const int64_t* offsets, int64_t n,
                        int64_t d, float* const* out, std::vector<const KV*>& ptrs, NextRows& next) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d == 64) {
    if constexpr (kMaxGroup >= 3) {
      if (group == 3) return weigh_group_64<3>(p, base, offsets, n, out, next);
      if (group == 2) return weigh_group_64<2>(p, base, offsets, n, out, next);
    }
    return weigh_group_64<1>(p, base, offsets, n, out, next);
  }
#endif
  ptrs.resize(n);
  for (int64_t t = 0; t < n; ++t) ptrs[t] = base + offsets[t], next.step();
  for (int b = 0; b < group; ++b) weigh_values_generic(p[b], ptrs.data(), n, d, out[b]);
}

// A unit: keys [key_begin, key_end) of one span, for all of its rows and heads.
struct Unit {
  int64_t span, key_begin, key_end, partial;  // partial: the unit's first partial row (n * H of them)
};

// Keys per split: `split_tokens`, halved (down to 32) while there are fewer than two units per
// thread, so that one or two long sequences still keep every core busy.
inline int64_t split_size(const int64_t* lens, int64_t S, int64_t split_tokens) {
  const int64_t want = 2 * at::get_num_threads();
  int64_t split = split_tokens;
  while (split > 32) {
    int64_t units = 0;
    for (int64_t s = 0; s < S; ++s) units += (lens[s] + split - 1) / split;
    if (units >= want) break;
    split = std::max<int64_t>(32, split / 2);
  }
  return split;
}

// Elem: float (a float32 pool) or bf16 (a bfloat16 pool); Q: float or bf16, q's element type.
template <typename Elem, typename Q>
at::Tensor paged_attention_of(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const kvgate::PagedInputs& in, double scale, int64_t split_tokens) {
  const int64_t T = in.T, H = in.H, D = in.D, BS = in.BS, KV = in.KV, G = in.G, S = in.S, W = in.W;
  const int64_t *starts = in.starts, *lens = in.lens, *table = in.table;
  const int64_t split = split_size(lens, S, split_tokens);

  std::vector<Unit> units;
  std::vector<int64_t> first_unit(S + 1, 0);
  int64_t partials = 0, max_rows = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = starts[s + 1] - starts[s], ctx = lens[s];
    max_rows = std::max(max_rows, n);
    first_unit[s] = static_cast<int64_t>(units.size());
    for (int64_t k0 = 0; k0 < ctx; k0 += split) {
      units.push_back({s, k0, std::min(ctx, k0 + split), partials});
      partials += n * H;
    }
  }
  first_unit[S] = static_cast<int64_t>(units.size());

  const auto f32 = q.options().dtype(at::kFloat);
  auto out = at::empty({T, H, D}, q.options());  // q's dtype: a bfloat16 row is rounded once, here
  auto part_acc = at::empty({std::max<int64_t>(partials, 1), D}, f32);
  auto part_ml = at::empty({std::max<int64_t>(partials, 1), 2}, f32);
  float* acc_all = part_acc.data_ptr<float>();
  float* ml_all = part_ml.data_ptr<float>();
  const Q* qp = static_cast<const Q*>(q.data_ptr());
  const int64_t q_row = q.stride(0);  // rows may be strided (a view of the fused q/k/v projection)
  const Elem* kp = static_cast<const Elem*>(k_cache.data_ptr());
  const Elem* vp = static_cast<const Elem*>(v_cache.data_ptr());
  const int64_t block_stride = k_cache.stride(0);
  const float fscale = static_cast<float>(scale);

#if defined(__AVX512BF16__)
  // bfloat16 q and pool of head size 64 multiply on `vdpbf16ps` (score_group_dot)
  const bool dot = std::is_same_v<Elem, bf16> && std::is_same_v<Q, bf16> && D == 64;
#else
  constexpr bool dot = false;
#endif
  const int64_t threads = at::get_num_threads();
  kvgate::parallel_claim(static_cast<int64_t>(units.size()), [&](kvgate::Claims& claim) {
    std::vector<float> qbuf(max_rows * H * D), scores;
    std::vector<uint32_t> pairs;
    std::vector<int64_t> offsets;
    std::vector<const Elem*> ptrs;
    std::vector<Elem> kloc, vloc;
    NextRows next;
    // a thread holds the unit it works on and the one it takes next, prefetching it (NextRows),
    // while at least one more unit is left per thread: the last ones go to whichever is free
    const auto ahead = [&](int64_t u) { return u >= 0 && claim.left() >= threads ? claim() : -1; };
    for (int64_t u = claim(), after = ahead(u); u >= 0;) {
      const Unit& unit = units[u];
      const int64_t s = unit.span, n = starts[s + 1] - starts[s], ctx = lens[s];
      const int64_t keys = unit.key_end - unit.key_begin;
      offsets.resize(keys);
      next.clear();
      if (after >= 0) {  // the unit after this one streams in meanwhile
        const Unit& a = units[after];
        const int64_t row = KV * D;
        for (int64_t t = a.key_begin; t < a.key_end;) {
          const int64_t run = std::min(a.key_end, (t / BS + 1) * BS) - t;
          const int64_t src = table[a.span * W + t / BS] * block_stride + (t % BS) * row;
          next.add(kp + src, vp + src, run * row * static_cast<int64_t>(sizeof(Elem)));
          t += run;
        }
        // calls of next.step() in this unit: per key tile of the scores, per key (pair) of the values
        const int64_t groups = KV * ((G + kMaxGroup - 1) / kMaxGroup);
        const int64_t score_steps = dot ? (keys + 15) / 16 : (D == 64 ? keys / 8 : keys);
        next.pace(n * groups * (score_steps + (dot ? (keys + 1) / 2 : keys)));
      }
      // A split's K/V lie in blocks far apart in the pool. A bfloat16 split widened to float32
      // is copied into a buffer of its own first: the copy streams the pieces in at memory
      // speed, where scoring them in place waits on each (a float32 split, twice the bytes,
      // gains nothing from it; the `vdpbf16ps` path reads in place: with less work per byte,
      // the copy costs it more than it saves).
      const Elem* kbase = kp;
      const Elem* vbase = vp;
      if (std::is_same_v<Elem, bf16> && !dot) {
        const int64_t row = KV * D;
        kloc.resize(keys * row);
        vloc.resize(keys * row);
        for (int64_t t = unit.key_begin; t < unit.key_end;) {
          const int64_t run = std::min(unit.key_end, (t / BS + 1) * BS) - t;
          const int64_t src = table[s * W + t / BS] * block_stride + (t % BS) * row;
          std::memcpy(kloc.data() + (t - unit.key_begin) * row, kp + src, run * row * sizeof(Elem));
          std::memcpy(vloc.data() + (t - unit.key_begin) * row, vp + src, run * row * sizeof(Elem));
          t += run;
        }
        for (int64_t t = 0; t < keys; ++t) offsets[t] = t * row;
        kbase = kloc.data();
        vbase = vloc.data();
      } else {
        for (int64_t t = unit.key_begin; t < unit.key_end; ++t) {
          const int64_t offset = table[s * W + t / BS] * block_stride + (t % BS) * KV * D;
          offsets[t - unit.key_begin] = offset;
        }
      }
      // query j = i * H + head: row starts[s] + i, scaled, as float32 (the dot path reads q as it is)
      if (!dot)
        for (int64_t j = 0; j < n * H; ++j) {
          const Q* src = qp + (starts[s] + j / H) * q_row + (j % H) * D;
          float* dst = qbuf.data() + j * D;
          for (int64_t e = 0; e < D; ++e) dst[e] = to_float(src[e]) * fscale;
        }
#if defined(__AVX512BF16__)
      const Q* qrows = qp + starts[s] * q_row;  // the dot path's queries: bfloat16, unscaled
#endif
      scores.resize(n * H * keys);
      for (int64_t i = 0; i < n; ++i) {
        // keys after row i's position are masked: it sees the first `visible` of this split
        const int64_t visible = std::min(keys, std::max<int64_t>(0, ctx - n + i + 1 - unit.key_begin));
        for (int64_t h = 0; h < KV; ++h) {
          for (int64_t g0 = 0; g0 < G; g0 += kMaxGroup) {
            const int group = static_cast<int>(std::min<int64_t>(kMaxGroup, G - g0));
            const float* qs[kMaxGroup];
            float* rows[kMaxGroup];
            float* accs[kMaxGroup];
            for (int b = 0; b < group; ++b) {
              const int64_t j = i * H + h * G + g0 + b;
              qs[b] = qbuf.data() + j * D;
              rows[b] = scores.data() + j * keys;
              accs[b] = acc_all + (unit.partial + j) * D;
            }
            if (visible == 0) {  // this split lies wholly after the row's position
              for (int b = 0; b < group; ++b) {
                float* ml = ml_all + (unit.partial + i * H + h * G + g0 + b) * 2;
                ml[0] = kNegInf;
                ml[1] = 0.0f;
                std::fill(accs[b], accs[b] + D, 0.0f);
              }
              continue;
            }
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<Elem, bf16> && std::is_same_v<Q, bf16>) {
              if (dot) {
                const bf16* qh[kMaxGroup];
                for (int b = 0; b < group; ++b) qh[b] = qrows + i * q_row + (h * G + g0 + b) * D;
                score_group_dot(qh, group, kbase + h * D, offsets.data(), visible, fscale, rows, next);
              }
            }
#endif
            if (!dot) score_group(qs, group, kbase + h * D, offsets.data(), visible, D, rows, ptrs, next);
            for (int b = 0; b < group; ++b) {
              float* row = rows[b];
              float m = kNegInf;
              for (int64_t t = 0; t < visible; ++t) m = std::max(m, row[t]);
#pragma omp simd
              for (int64_t t = 0; t < visible; ++t) row[t] -= m;
              exp_nonpositive(row, visible);
              float l = 0.0f;
#pragma omp simd reduction(+ : l)
              for (int64_t t = 0; t < visible; ++t) l += row[t];
              float* ml = ml_all + (unit.partial + i * H + h * G + g0 + b) * 2;
              ml[0] = m;
              ml[1] = l;
            }
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<Elem, bf16> && std::is_same_v<Q, bf16>) {
              if (dot) weigh_group_dot(rows, group, vbase + h * D, offsets.data(), visible, accs, pairs, next);
            }
#endif
            if (!dot) weigh_group(rows, group, vbase + h * D, offsets.data(), visible, D, accs, ptrs, next);
          }
        }
      }
      u = after >= 0 ? after : claim();
      after = ahead(u);
    }
  });

  // merge the splits of each span into its output rows
  Q* op = static_cast<Q*>(out.data_ptr());
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t n = starts[s + 1] - starts[s], u0 = first_unit[s], splits = first_unit[s + 1] - u0;
      for (int64_t j = 0; j < n * H; ++j) {
        float* dst = row.data();
        Q* to = op + (starts[s] * H + j) * D;
        if (splits == 1) {  // one split: its partial row is the answer
          const int64_t p = units[u0].partial + j;
          const float inv = 1.0f / ml_all[p * 2 + 1];
          const float* src = acc_all + p * D;
#pragma omp simd
          for (int64_t e = 0; e < D; ++e) to[e] = narrow<Q>(src[e] * inv);
          continue;
        }
        float m = kNegInf;
        for (int64_t c = 0; c < splits; ++c) m = std::max(m, ml_all[(units[u0 + c].partial + j) * 2]);
        std::fill(dst, dst + D, 0.0f);
        float l = 0.0f;
        for (int64_t c = 0; c < splits; ++c) {
          const int64_t p = units[u0 + c].partial + j;
          if (ml_all[p * 2 + 1] == 0.0f) continue;
          const float w = std::exp(ml_all[p * 2] - m);
          l += w * ml_all[p * 2 + 1];
          const float* src = acc_all + p * D;
#pragma omp simd
          for (int64_t e = 0; e < D; ++e) dst[e] += w * src[e];
        }
        const float inv = 1.0f / l;
#pragma omp simd
        for (int64_t e = 0; e < D; ++e) to[e] = narrow<Q>(dst[e] * inv);
      }
    }
  });
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& tables, const at::Tensor& q_start, const at::Tensor& ctx_lens,
                           double scale, int64_t split_tokens) {
  const kvgate::PagedInputs in = kvgate::check_paged_inputs(q, k_cache, v_cache, tables, q_start, ctx_lens, true);
  TORCH_CHECK(split_tokens > 0, "split_tokens must be positive");
  return kvgate::by_element_types(q, k_cache, [&](auto elem, auto q_elem) {
    return paged_attention_of<decltype(elem), decltype(q_elem)>(q, k_cache, v_cache, in, scale, split_tokens);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgate, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor q_start, "
        "Tensor ctx_lens, float scale, int split_tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgate, CPU, m) { m.impl("paged_attention", &paged_attention); }
