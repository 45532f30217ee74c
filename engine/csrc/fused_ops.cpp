// Fused element-wise steps of a Llama-family decoder layer on CPU, float32 (engine/fast_decoder.py).
//
// Each replaces several PyTorch ops (and their dispatch, allocations and passes over memory):
//   add_rms_norm(x, residual, weight, eps)  residual += x (in place), returns rms_norm(residual) * weight
//   rms_norm(x, weight, eps)                returns rms_norm(x) * weight
//   rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)
//       rotates q and k in place (rotate-half convention, cos/sin [T, D]) and writes k, v into the
//       paged pool at (blocks[t], offsets[t])
//   silu_mul(gate_up)                       returns silu(gate) * up for gate_up = [gate | up]
// The arithmetic is the one transformers' modules do (x * rsqrt(mean(x^2) + eps), x * sigmoid(x));
// only the order of the float sums differs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "vec_math.h"

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              " must be a float32 [rows, features] tensor with contiguous rows");
}

// rms-normalise `n` values of `src` into `dst` with `weight`.
inline void normalize(const float* src, const float* weight, float eps, int64_t n, float* dst) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += src[i] * src[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = weight[i] * (src[i] * inv);
}

at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == at::kFloat, "x, residual and weight must agree in shape");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* res = rp + r * rs;
      const float* src = xp + r * xs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) res[i] += src[i];
      normalize(res, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == at::kFloat,
              "weight must match x's features");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize(xp + r * xs, wp, static_cast<float>(eps), n, op + r * n);
  });
  return out;
}

// x[h] for each head h of one token: x = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
inline void rotate(float* x, int64_t heads, int64_t head_stride, const float* cos, const float* sin, int64_t d,
                   float* tmp) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_stride;
    std::memcpy(tmp, v, sizeof(float) * d);
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) v[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i];
#pragma omp simd
    for (int64_t i = half; i < d; ++i) v[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
  }
}

void rope_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& blocks, const at::Tensor& offsets) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0),
              "q must be [T, H, D], k and v [T, KV, D]");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k and v must be float32 with contiguous heads");
  const int64_t T = q.size(0), H = q.size(1), KV = k.size(1), D = q.size(2);
  TORCH_CHECK(k.size(2) == D && D % 2 == 0, "q and k must share an even head size");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "cos and sin must be contiguous float32 [T, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == KV &&
                  k_cache.size(3) == D && k_cache.stride(3) == 1 && k_cache.stride(2) == D &&
                  k_cache.stride(1) == KV * D && v_cache.stride(3) == 1 && v_cache.stride(2) == D &&
                  v_cache.stride(1) == KV * D && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "k/v cache must be float32 [NB, BS, KV, D], contiguous blocks");
  TORCH_CHECK(blocks.numel() == T && offsets.numel() == T && blocks.scalar_type() == at::kLong &&
                  offsets.scalar_type() == at::kLong && blocks.is_contiguous() && offsets.is_contiguous(),
              "blocks and offsets must be int64 [T]");
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1);
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* offp = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(bp[t] >= 0 && bp[t] < nb && offp[t] >= 0 && offp[t] < bs, "slot ", t, " is outside the pool");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), cache_stride = k_cache.stride(0);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      rotate(qp + t * qs, H, D, cp + t * D, sp + t * D, D, tmp.data());
      rotate(kp + t * ks, KV, D, cp + t * D, sp + t * D, D, tmp.data());
      const int64_t slot = bp[t] * cache_stride + offp[t] * KV * D;
      std::memcpy(kc + slot, kp + t * ks, sizeof(float) * KV * D);
      std::memcpy(vc + slot, vp + t * vs, sizeof(float) * KV * D);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up halves");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + n;
      float* o = op + r * n;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8)
        kvgate::store8(o + i, kvgate::silu_mul_lanes<kvgate::f32x8, kvgate::i32x8>(kvgate::load8(g + i), kvgate::load8(u + i)));
      for (; i < n; ++i) o[i] = g[i] / (1.0f + kvgate::exp_clamped(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgate, m) {
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_write_kv(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, Tensor(c!) k_cache, "
        "Tensor(d!) v_cache, Tensor blocks, Tensor offsets) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgate, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("silu_mul", &silu_mul);
}
