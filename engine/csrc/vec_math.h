// Math shared by KVGate's CPU kernels, written so that GCC vectorises the loops that call it
// (with -fno-trapping-math: branch-free clamps, no libm calls).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvgate {

// A bfloat16 value as the kernels hold it (its bits), and either element type read as float32
// (bfloat16: the upper half of a float32's bits).
using bf16 = uint16_t;
inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

// Eight lanes at a time (GCC vector extensions: AVX registers where there are, pairs of SSE or
// NEON registers elsewhere).
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// A float32's bits rounded to bfloat16 (to nearest even, as PyTorch rounds), the result in the
// upper half and the lower half zero; a NaN stays a (quiet) NaN. U is uint32_t or a vector of
// them: the scalar and the vector rounding share this.
template <typename U>
inline U bf16_rounded_bits(U u) {
  const U rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  const U nan = (u | 0x400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

// f as a T (float or bf16): itself, or rounded to bfloat16 as above.
template <typename T>
inline T narrow(float f) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return f;
  } else {
    return static_cast<bf16>(bf16_rounded_bits(__builtin_bit_cast(uint32_t, f)) >> 16);
  }
}

// For v already clamped to [-87, 88]: v = k ln2 + r with |r| <= ln2/2 (k returned, rounded to
// nearest), and exp(r) by a degree-7 Taylor polynomial (relative error < 2e-8 on that range).
// T is float or f32x8: the scalar and the vector exp share this arithmetic.
template <typename T>
inline T exp_reduced(T v, T& k) {
  k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const T r = v - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  T p = T{} + 1.98412698e-04f;
  p = p * r + 1.38888889e-03f;
  p = p * r + 8.33333333e-03f;
  p = p * r + 4.16666667e-02f;
  p = p * r + 1.66666667e-01f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

// exp(x) for any float: clamped to [-87, 88], then exp(r) * 2^k with 2^k built in the exponent.
inline float exp_clamped(float x) {
  const float v = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  float k;
  const float p = exp_reduced(v, k);
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
}

// p * 2^k lane by lane, for k integral in [-126, 127], 2^k built in the exponent. V a float
// vector type, I the int32 vector type of as many lanes.
template <typename V, typename I>
inline V times_pow2(V p, V k) {
  return p * reinterpret_cast<V>((__builtin_convertvector(k, I) + 127) << 23);
}

// The same exp on vectors. Loops whose result divides by the exp use this form: from the scalar
// form GCC if-converts the clamp into per-range paths computed on every lane and blended, and
// SiLU's clamped path (x / (1 + exp(88))) makes a denormal on every vector, each a microcode
// assist on CPUs that have them (docs/engine.md). Here the clamp is a select on the vector: no
// lane takes a path.
template <typename V, typename I>
inline V exp_clamped_lanes(V x) {
  const V lo = V{} - 87.0f, hi = V{} + 88.0f;
  V v = x < lo ? lo : x;
  v = v > hi ? hi : v;
  V k;
  const V p = exp_reduced(v, k);
  return times_pow2<V, I>(p, k);
}

// SiLU(g) * u lane by lane: fused_ops.cpp's silu_mul on 8 lanes, the panel kernel's gated epilogue
// on its wide vectors.
template <typename V, typename I>
inline V silu_mul_lanes(V g, V u) { return g / (1.0f + exp_clamped_lanes<V, I>(-g)) * u; }

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

// One register of lanes, as wide as the build's vectors: the GEMM-shaped kernels' unit.
#if defined(__AVX512F__)
constexpr int kWideLanes = 16;  // a zmm register
#else
constexpr int kWideLanes = 8;   // a ymm register, or a pair of 128-bit ones
#endif
typedef float f32xw __attribute__((vector_size(kWideLanes * 4)));
typedef int32_t i32xw __attribute__((vector_size(kWideLanes * 4)));

inline f32xw loadw(const float* p) {
  f32xw v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storew(float* p, f32xw v) { std::memcpy(p, &v, sizeof v); }

// x in every lane. x - 0 is x for every float (-0 included), so GCC emits a plain broadcast; x + 0
// is not x for -0, and cost a scalar add before every broadcast of the kernels' inner loops
// (~3 % of a 64-row attention chunk's time)
inline f32xw splatw(float x) { return x - f32xw{}; }

// An AVX-512 mask (__mmask16) of the first n of 16 lanes: all for n >= 16, none for n <= 0 (a
// tail's masked loads and stores; a shift by a negative count would be undefined).
inline uint16_t first_lanes(int64_t n) {
  return n >= 16 ? 0xffffu : n <= 0 ? 0u : static_cast<uint16_t>((1u << n) - 1u);
}

}  // namespace kvgate
