// What this machine's cores can do at most, measured the way the kernels use them: the float32
// FMA rate with every thread busy, and the rate at which all threads together read memory. The
// benchmarks (bench/linear_bench.py) report the matmuls as fractions of these two.
//
// fma_peak: each thread runs `iters` rounds of kChains independent vector FMA chains (enough
// chains to cover the FMA latency on two pipes), so nothing but the FMA units limits it.
// read_bandwidth: each thread sums its share of a float32 tensor far larger than the caches with
// vector loads and four independent sums (a read stream, no writes), `repeats` times; the best
// pass counts.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "vec_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using vec = kvgate::f32xw;
constexpr int kLanes = kvgate::kWideLanes;
constexpr int kChains = 12;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double fma_peak(int64_t iters) {
  TORCH_CHECK(iters > 0, "fma_peak: iters must be positive");
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  std::atomic<float> scale{1.0000001f}, shift{0.9999999f};
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0_, int64_t t1_) {
    for (int64_t t = t0_; t < t1_; ++t) {
      vec acc[kChains];
      // from memory the compiler cannot see through: no round can be folded away
      const vec a = kvgate::splatw(scale.load()), b = kvgate::splatw(shift.load());
      for (int c = 0; c < kChains; ++c) acc[c] = kvgate::splatw(static_cast<float>(c + t));
      for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = acc[c] * a + b;
      }
      float total = 0.0f;
      for (int c = 0; c < kChains; ++c) total += acc[c][0];
      sink += static_cast<int64_t>(total) & 1;
    }
  });
  const double elapsed = seconds_since(t0);
  return 2.0 * kLanes * kChains * static_cast<double>(iters) * static_cast<double>(threads) / elapsed / 1e9 +
         0.0 * static_cast<double>(sink.load());
}

// The bfloat16 counterpart: `vdpbf16ps` (AVX512-BF16), two bfloat16 products per float32 lane
// added into it, kChains chains per thread; 0 where the build has no such instruction.
double bf16_dot_peak(int64_t iters) {
  TORCH_CHECK(iters > 0, "bf16_dot_peak: iters must be positive");
#if defined(__AVX512BF16__)
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  std::atomic<float> scale{1.0000001f};
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0_, int64_t t1_) {
    for (int64_t t = t0_; t < t1_; ++t) {
      __m512 acc[kChains];
      const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(scale.load()), _mm512_set1_ps(scale.load()));
      for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c + t));
      for (int64_t i = 0; i < iters; ++i)
#pragma GCC unroll 12
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
      float total = 0.0f;
      for (int c = 0; c < kChains; ++c) total += _mm512_cvtss_f32(acc[c]);
      sink += static_cast<int64_t>(total) & 1;
    }
  });
  const double elapsed = seconds_since(t0);
  return 4.0 * 16 * kChains * static_cast<double>(iters) * static_cast<double>(threads) / elapsed / 1e9 +
         0.0 * static_cast<double>(sink.load());
#else
  return 0.0;
#endif
}

double read_bandwidth(const at::Tensor& data, int64_t repeats) {
  TORCH_CHECK(data.scalar_type() == at::kFloat && data.is_contiguous() && data.device().is_cpu(),
              "read_bandwidth takes a contiguous float32 CPU tensor");
  TORCH_CHECK(repeats > 0, "read_bandwidth: repeats must be positive");
  const float* p = data.data_ptr<float>();
  const int64_t n = data.numel() / (4 * kLanes) * (4 * kLanes);
  double best = 0.0;
  std::atomic<int64_t> sink{0};
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, n / (4 * kLanes), 4096, [&](int64_t b0, int64_t b1) {
      vec s0{}, s1{}, s2{}, s3{};
      for (int64_t b = b0; b < b1; ++b) {
        const float* q = p + b * 4 * kLanes;
        s0 += kvgate::loadw(q);
        s1 += kvgate::loadw(q + kLanes);
        s2 += kvgate::loadw(q + 2 * kLanes);
        s3 += kvgate::loadw(q + 3 * kLanes);
      }
      const vec s = (s0 + s1) + (s2 + s3);
      sink += static_cast<int64_t>(s[0]) & 1;
    });
    best = std::max(best, static_cast<double>(n) * sizeof(float) / seconds_since(t0) / 1e9);
  }
  return best + 0.0 * static_cast<double>(sink.load());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvgate, m) {
  m.def("fma_peak(int iters) -> float", &fma_peak);
  m.def("read_bandwidth(Tensor data, int repeats) -> float", &read_bandwidth);
  m.def("bf16_dot_peak(int iters) -> float", &bf16_dot_peak);
}
