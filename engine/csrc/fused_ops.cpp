// Fused element-wise steps of a Llama-family decoder layer on CPU, float32 or bfloat16
// (engine/fast_decoder.py; every tensor of one call in the same dtype).
//
// Each replaces several PyTorch ops (and their dispatch, allocations and passes over memory):
//   add_rms_norm(x, residual, weight, eps)  residual += x (in place), returns rms_norm(residual) * weight
//   rms_norm(x, weight, eps)                returns rms_norm(x) * weight
//   rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, blocks, offsets)
//       rotates q and k in place (rotate-half convention, cos/sin [T, D]) and writes k, v into the
//       paged pool at (blocks[t], offsets[t])
//   silu_mul(gate_up)                       returns silu(gate) * up for gate_up = [gate | up]
// The arithmetic is the one transformers' modules do (x * rsqrt(mean(x^2) + eps), x * sigmoid(x)),
// in bfloat16 with their roundings; only the order of the float sums differs.

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
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

// Element types: float32, or bfloat16 (its bits). A bfloat16 op computes in float32 and rounds
// (to nearest even) wherever transformers' bfloat16 modules round: after every op of theirs
// (`narrow`), so the result is theirs but for the order of the sums.
using kvgate::bf16;
using kvgate::to_float;
using kvgate::narrow;
// f as a T holds it (float32: f itself)
template <typename T>
inline float held(float f) { return to_float(narrow<T>(f)); }

bool is_bf16(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && (t.scalar_type() == at::kFloat || is_bf16(t)) && t.stride(1) == 1, name,
              " must be a float32 or bfloat16 [rows, features] tensor with contiguous rows");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, " must have one dtype (", a.scalar_type(), " and ",
              b.scalar_type(), ")");
}

// rms-normalise `n` values of `src` into `dst` with `weight`: weight * T(src * rsqrt(mean(src^2) + eps)).
template <typename T>
inline void normalize(const T* src, const T* weight, float eps, int64_t n, T* dst) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += to_float(src[i]) * to_float(src[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = narrow<T>(to_float(weight[i]) * held<T>(to_float(src[i]) * inv));
}

template <typename T>
void add_rms_norm_of(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                     at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = static_cast<const T*>(x.data_ptr());
  T* rp = static_cast<T*>(residual.data_ptr());
  const T* wp = static_cast<const T*>(weight.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = rp + r * rs;
      const T* src = xp + r * xs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) res[i] = narrow<T>(to_float(res[i]) + to_float(src[i]));
      normalize(res, wp, static_cast<float>(eps), n, op + r * n);
    }
  });
}

at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_same(x, residual, "x and residual");
  check_same(x, weight, "x and weight");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.is_contiguous() && weight.numel() == x.size(1),
              "x, residual and weight must agree in shape");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (is_bf16(x))
    add_rms_norm_of<bf16>(x, residual, weight, eps, out);
  else
    add_rms_norm_of<float>(x, residual, weight, eps, out);
  return out;
}

template <typename T>
void rms_norm_of(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(weight.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) normalize(xp + r * xs, wp, static_cast<float>(eps), n, op + r * n);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_same(x, weight, "x and weight");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must match x's features");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (is_bf16(x))
    rms_norm_of<bf16>(x, weight, eps, out);
  else
    rms_norm_of<float>(x, weight, eps, out);
  return out;
}

// x[h] for each head h of one token: x = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
// (each product and the sum held as T, as transformers' modules compute it).
template <typename T>
inline void rotate(T* x, int64_t heads, int64_t head_stride, const T* cos, const T* sin, int64_t d, float* tmp) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * head_stride;
    for (int64_t i = 0; i < d; ++i) tmp[i] = to_float(v[i]);
#pragma omp simd
    for (int64_t i = 0; i < half; ++i)
      v[i] = narrow<T>(held<T>(tmp[i] * to_float(cos[i])) + held<T>(-tmp[i + half] * to_float(sin[i])));
#pragma omp simd
    for (int64_t i = half; i < d; ++i)
      v[i] = narrow<T>(held<T>(tmp[i] * to_float(cos[i])) + held<T>(tmp[i - half] * to_float(sin[i])));
  }
}

template <typename T>
void rope_write_kv_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const int64_t* bp, const int64_t* offp) {
  const int64_t T_ = q.size(0), H = q.size(1), KV = k.size(1), D = q.size(2);
  T* qp = static_cast<T*>(q.data_ptr());
  T* kp = static_cast<T*>(k.data_ptr());
  const T* vp = static_cast<const T*>(v.data_ptr());
  const T* cp = static_cast<const T*>(cos.data_ptr());
  const T* sp = static_cast<const T*>(sin.data_ptr());
  T* kc = static_cast<T*>(k_cache.data_ptr());
  T* vc = static_cast<T*>(v_cache.data_ptr());
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), cache_stride = k_cache.stride(0);
  at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      rotate(qp + t * qs, H, D, cp + t * D, sp + t * D, D, tmp.data());
      rotate(kp + t * ks, KV, D, cp + t * D, sp + t * D, D, tmp.data());
      const int64_t slot = bp[t] * cache_stride + offp[t] * KV * D;
      std::memcpy(kc + slot, kp + t * ks, sizeof(T) * KV * D);
      std::memcpy(vc + slot, vp + t * vs, sizeof(T) * KV * D);
    }
  });
}

void rope_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& blocks, const at::Tensor& offsets) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0),
              "q must be [T, H, D], k and v [T, KV, D]");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK((t->scalar_type() == at::kFloat || is_bf16(*t)) && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "q, k and v must be float32 or bfloat16 with contiguous heads");
  for (const at::Tensor* t : {&k, &v, &cos, &sin, &k_cache, &v_cache}) check_same(q, *t, "q, k, v, cos, sin and the cache");
  const int64_t T = q.size(0), KV = k.size(1), D = q.size(2);
  TORCH_CHECK(k.size(2) == D && D % 2 == 0, "q and k must share an even head size");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous(), "cos and sin must be contiguous [T, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == KV &&
                  k_cache.size(3) == D && k_cache.stride(3) == 1 && k_cache.stride(2) == D &&
                  k_cache.stride(1) == KV * D && v_cache.stride(3) == 1 && v_cache.stride(2) == D &&
                  v_cache.stride(1) == KV * D, "k/v cache must be [NB, BS, KV, D], contiguous blocks");
  TORCH_CHECK(blocks.numel() == T && offsets.numel() == T && blocks.scalar_type() == at::kLong &&
                  offsets.scalar_type() == at::kLong && blocks.is_contiguous() && offsets.is_contiguous(),
              "blocks and offsets must be int64 [T]");
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1);
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* offp = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(bp[t] >= 0 && bp[t] < nb && offp[t] >= 0 && offp[t] < bs, "slot ", t, " is outside the pool");
  if (is_bf16(q))
    rope_write_kv_of<bf16>(q, k, v, cos, sin, k_cache, v_cache, bp, offp);
  else
    rope_write_kv_of<float>(q, k, v, cos, sin, k_cache, v_cache, bp, offp);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up halves");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  const int64_t gs = gate_up.stride(0);
  if (is_bf16(gate_up)) {  // SiLU(gate) held as bfloat16, then the product
    const bf16* gp = static_cast<const bf16*>(gate_up.data_ptr());
    bf16* op = static_cast<bf16*>(out.data_ptr());
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const bf16* g = gp + r * gs;
        for (int64_t i = 0; i < n; ++i) {
          const float x = to_float(g[i]);
          op[r * n + i] = narrow<bf16>(held<bf16>(x / (1.0f + kvgate::exp_clamped(-x))) * to_float(g[n + i]));
        }
      }
    });
    return out;
  }
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
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
