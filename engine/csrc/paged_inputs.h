// The inputs both attention kernels take, checked once (paged_attention.cpp, chunk_attention.cpp):
//   q          [T, H, D] float32 (or bfloat16 where the kernel says so), heads contiguous (the
//              kernel says whether rows may be strided)
//   k/v cache  [NB, BS, KV, D] float32 (or bfloat16, likewise): a layer's view, any block stride,
//              contiguous inside a block
//   tables     [S, W] int64   block ids of span s's context, in order (padded)
//   q_start    [S + 1] int64  span s owns q rows q_start[s] .. q_start[s+1]-1
//   ctx_lens   [S] int64      keys of span s; its last row sits at position ctx_len - 1
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "vec_math.h"  // kvgate::bf16

namespace kvgate {

// kernel(Elem{}, Q{}) for the element types of the pool (k_cache) and of q, each float or bf16:
// how both kernels pick their template instance.
template <typename Kernel>
at::Tensor by_element_types(const at::Tensor& q, const at::Tensor& k_cache, const Kernel& kernel) {
  const bool bf16_q = q.scalar_type() == at::kBFloat16;
  if (k_cache.scalar_type() == at::kBFloat16) return bf16_q ? kernel(bf16{}, bf16{}) : kernel(bf16{}, float{});
  return bf16_q ? kernel(float{}, bf16{}) : kernel(float{}, float{});
}

struct PagedInputs {
  int64_t T, H, D, BS, KV, G, S, W, NB, block_stride;
  const int64_t* starts;
  const int64_t* lens;
  const int64_t* table;
};

// Every check that keeps the kernels inside their tensors: shapes, dtypes, layouts, each span's
// rows within its context, its context within its table, every block id it reads within the pool.
inline PagedInputs check_paged_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& tables, const at::Tensor& q_start,
                                      const at::Tensor& ctx_lens, bool bf16 = false) {
  const auto takes = [bf16](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat || (bf16 && t.scalar_type() == at::kBFloat16);
  };
  const char* types = bf16 ? "float32 or bfloat16" : "float32";
  TORCH_CHECK(q.dim() == 3 && takes(q), "q must be [T, H, D] ", types);
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "k/v cache must be [NB, BS, KV, D]");
  TORCH_CHECK(takes(k_cache) && v_cache.scalar_type() == k_cache.scalar_type(), "k/v cache must be ", types,
              " (both the same)");
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0), "k and v caches must share a block stride");
  PagedInputs in{};
  in.BS = k_cache.size(1);
  in.KV = k_cache.size(2);
  in.D = k_cache.size(3);
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == in.D && k_cache.stride(1) == in.KV * in.D &&
              v_cache.stride(3) == 1 && v_cache.stride(2) == in.D && v_cache.stride(1) == in.KV * in.D,
              "k/v cache blocks must be contiguous inside");
  in.T = q.size(0);
  in.H = q.size(1);
  TORCH_CHECK(q.size(2) == in.D && in.H % in.KV == 0, "q heads must be a multiple of kv heads, same head dim");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == in.D, "q must have contiguous heads");
  TORCH_CHECK(tables.dim() == 2 && tables.is_contiguous() && tables.scalar_type() == at::kLong, "tables must be [S, W] int64");
  in.S = tables.size(0);
  in.W = tables.size(1);
  TORCH_CHECK(q_start.numel() == in.S + 1 && q_start.scalar_type() == at::kLong && q_start.is_contiguous(),
              "q_start must be [S + 1] int64");
  TORCH_CHECK(ctx_lens.numel() == in.S && ctx_lens.scalar_type() == at::kLong && ctx_lens.is_contiguous(),
              "ctx_lens must be [S] int64");
  in.G = in.H / in.KV;
  in.NB = k_cache.size(0);
  in.block_stride = k_cache.stride(0);
  in.starts = q_start.data_ptr<int64_t>();
  in.lens = ctx_lens.data_ptr<int64_t>();
  in.table = tables.data_ptr<int64_t>();
  TORCH_CHECK(in.starts[0] == 0 && in.starts[in.S] == in.T, "q_start must run from 0 to T");
  for (int64_t s = 0; s < in.S; ++s) {
    const int64_t n = in.starts[s + 1] - in.starts[s], ctx = in.lens[s];
    TORCH_CHECK(n >= 1 && n <= ctx && ctx <= in.W * in.BS, "span ", s, ": rows and context length do not fit its table");
    for (int64_t b = 0; b < (ctx + in.BS - 1) / in.BS; ++b) {
      const int64_t id = in.table[s * in.W + b];
      TORCH_CHECK(id >= 0 && id < in.NB, "span ", s, ": block id ", id, " out of range");
    }
  }
  return in;
}

}  // namespace kvgate
