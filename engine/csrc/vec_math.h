// Math shared by KVGate's CPU kernels, written so that GCC vectorises the loops that call it
// (with -fno-trapping-math: branch-free clamps, no libm calls).
#pragma once

#include <cstdint>

namespace kvgate {

// exp(x) for any float: clamped to [-87, 88], x = n ln2 + r with |r| <= ln2/2, exp(r) by a
// degree-7 Taylor polynomial (relative error < 2e-8 on that range), 2^n built in the exponent.
inline float exp_clamped(float x) {
  const float v = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = v - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  float p = 1.98412698e-04f;
  p = p * r + 1.38888889e-03f;
  p = p * r + 8.33333333e-03f;
  p = p * r + 4.16666667e-02f;
  p = p * r + 1.66666667e-01f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
}

}  // namespace kvgate
