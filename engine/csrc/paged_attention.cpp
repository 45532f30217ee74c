// Paged attention for few query rows per sequence (decodes, short prefill chunks) on CPU.
//
// Reads K/V where they lie in the block pool (no gather into a contiguous copy) and reads each
// block once per KV head: the query heads that share a KV head (GQA) and the span's rows are
// scored together. A sequence's context is cut into splits of `split_tokens` keys so that a
// single long sequence still keeps every core busy; each split keeps its own softmax max, sum
// and weighted values, merged at the end (the usual log-sum-exp combination).
//
// Shapes (float32 or bfloat16 q and pool, computed in float32; the layouts engine/attention.py has):
//   q          [T, H, D]                 contiguous; rows of span s are q_start[s] .. q_start[s+1]-1
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

#if defined(__AVX2__) && defined(__FMA__)
// The same two loops for head size 64 with AVX2: eight keys scored at once (eight accumulators,
// one horizontal reduction per eight keys); the 64 output values held in eight registers.
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

template <typename KV>
inline void score_row_64(const float* q, const KV* const* keys, int64_t n, float* row) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    __m256 acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps();
    for (int c = 0; c < 8; ++c) {
      const __m256 qv = _mm256_loadu_ps(q + c * 8);
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qv, load8(keys[t + k] + c * 8), acc[k]);
    }
    _mm256_storeu_ps(row + t, hsum8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]));
  }
  if (t < n) score_row_generic(q, keys + t, n - t, 64, row + t);
}

template <typename KV>
inline void weigh_values_64(const float* p, const KV* const* values, int64_t n, float* out) {
  __m256 acc[8];
  for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const KV* v = values[t];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, load8(v + c * 8), acc[c]);
  }
  for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + c * 8, acc[c]);
}
#endif

template <typename KV>
inline void score_row(const float* q, const KV* const* keys, int64_t n, int64_t d, float* row) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d == 64) return score_row_64(q, keys, n, row);
#endif
  score_row_generic(q, keys, n, d, row);
}

template <typename KV>
inline void weigh_values(const float* p, const KV* const* values, int64_t n, int64_t d, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d == 64) return weigh_values_64(p, values, n, out);
#endif
  weigh_values_generic(p, values, n, d, out);
}

struct Unit {
  int64_t span, kv_head, key_begin, key_end, partial;  // partial: first partial row of this unit
};

// Elem: float (a float32 pool) or bf16 (a bfloat16 pool); Q: float or bf16, q's element type.
template <typename Elem, typename Q>
at::Tensor paged_attention_of(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const kvgate::PagedInputs& in, double scale, int64_t split_tokens) {
  const int64_t T = in.T, H = in.H, D = in.D, BS = in.BS, KV = in.KV, G = in.G, S = in.S, W = in.W;
  const int64_t *starts = in.starts, *lens = in.lens, *table = in.table;

  std::vector<Unit> units;
  int64_t partials = 0, max_rows = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = starts[s + 1] - starts[s], ctx = lens[s];
    max_rows = std::max(max_rows, n);
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t k0 = 0; k0 < ctx; k0 += split_tokens) {
        units.push_back({s, h, k0, std::min(ctx, k0 + split_tokens), partials});
        partials += n * G;
      }
  }

  const auto f32 = q.options().dtype(at::kFloat);
  auto out = at::empty({T, H, D}, f32);
  auto part_acc = at::empty({std::max<int64_t>(partials, 1), D}, f32);
  auto part_ml = at::empty({std::max<int64_t>(partials, 1), 2}, f32);
  float* acc_all = part_acc.data_ptr<float>();
  float* ml_all = part_ml.data_ptr<float>();
  const Q* qp = static_cast<const Q*>(q.data_ptr());
  const Elem* kp = static_cast<const Elem*>(k_cache.data_ptr());
  const Elem* vp = static_cast<const Elem*>(v_cache.data_ptr());
  const int64_t block_stride = k_cache.stride(0);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf(max_rows * G * D), row_buf;
    std::vector<const Elem*> kptrs, vptrs;
    for (int64_t u = begin; u < end; ++u) {
      const Unit& unit = units[u];
      const int64_t s = unit.span, n = starts[s + 1] - starts[s], ctx = lens[s], nq = n * G;
      const int64_t keys = unit.key_end - unit.key_begin;
      row_buf.resize(keys);
      // query j = i * G + g: row starts[s] + i, head kv_head * G + g, already scaled
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const Q* src = qp + ((starts[s] + i) * H + unit.kv_head * G + g) * D;
          float* dst = qbuf.data() + (i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d]) * fscale;
        }
      kptrs.resize(keys);
      vptrs.resize(keys);
      for (int64_t t = unit.key_begin; t < unit.key_end; ++t) {
        const int64_t offset = table[s * W + t / BS] * block_stride + ((t % BS) * KV + unit.kv_head) * D;
        kptrs[t - unit.key_begin] = kp + offset;
        vptrs[t - unit.key_begin] = vp + offset;
      }
      for (int64_t j = 0; j < nq; ++j) {
        // keys after row i's position are masked; a row sees keys < visible_end
        const int64_t visible = std::min(keys, std::max<int64_t>(0, ctx - n + j / G + 1 - unit.key_begin));
        float* row = row_buf.data();
        score_row(qbuf.data() + j * D, kptrs.data(), visible, D, row);
        float* ml = ml_all + (unit.partial + j) * 2;
        float* acc = acc_all + (unit.partial + j) * D;
        if (visible == 0) {  // this split lies wholly after the row's position
          ml[0] = kNegInf;
          ml[1] = 0.0f;
          std::fill(acc, acc + D, 0.0f);
          continue;
        }
        float m = kNegInf;
        for (int64_t t = 0; t < visible; ++t) m = std::max(m, row[t]);
#pragma omp simd
        for (int64_t t = 0; t < visible; ++t) row[t] -= m;
        exp_nonpositive(row, visible);
        float l = 0.0f;
#pragma omp simd reduction(+ : l)
        for (int64_t t = 0; t < visible; ++t) l += row[t];
        ml[0] = m;
        ml[1] = l;
        weigh_values(row, vptrs.data(), visible, D, acc);
      }
    }
  });

  // merge the splits of each (span, kv head) into the output rows
  std::vector<int64_t> first_unit(S * KV + 1, 0);
  for (size_t u = 0; u < units.size(); ++u) {
    const int64_t key = units[u].span * KV + units[u].kv_head;
    if (u == 0 || units[u - 1].span * KV + units[u - 1].kv_head != key) first_unit[key] = static_cast<int64_t>(u);
  }
  float* op = out.data_ptr<float>();
  at::parallel_for(0, S * KV, 1, [&](int64_t begin, int64_t end) {
    for (int64_t key = begin; key < end; ++key) {
      const int64_t s = key / KV, h = key % KV, n = starts[s + 1] - starts[s];
      const int64_t u0 = first_unit[key], splits = (lens[s] + split_tokens - 1) / split_tokens;
      for (int64_t j = 0; j < n * G; ++j) {
        float m = kNegInf;
        for (int64_t c = 0; c < splits; ++c) m = std::max(m, ml_all[(units[u0 + c].partial + j) * 2]);
        float* dst = op + ((starts[s] + j / G) * H + h * G + j % G) * D;
        std::fill(dst, dst + D, 0.0f);
        float l = 0.0f;
        for (int64_t c = 0; c < splits; ++c) {
          const int64_t p = units[u0 + c].partial + j;
          if (ml_all[p * 2 + 1] == 0.0f) continue;
          const float w = std::exp(ml_all[p * 2] - m);
          l += w * ml_all[p * 2 + 1];
          const float* src = acc_all + p * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] += w * src[d];
        }
        const float inv = 1.0f / l;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
      }
    }
  });
  return std::is_same_v<Q, float> ? out : out.to(q.scalar_type());
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& tables, const at::Tensor& q_start, const at::Tensor& ctx_lens,
                           double scale, int64_t split_tokens) {
  const kvgate::PagedInputs in = kvgate::check_paged_inputs(q, k_cache, v_cache, tables, q_start, ctx_lens, true);
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
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
