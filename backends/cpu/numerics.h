// The scalar numerics every CPU kernel shares: log2(e), bf16 <-> fp32, the exp2 polynomial (scalar and per
// vector lane), and simd.h's vector layer. Included by each kernel header; part of one translation unit per entry
// family (attention.cpp, kv_write.cpp, linear.cpp, llama_layer.cpp), all in internal linkage.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// e^r for |r| <= ln(2) / 2: Taylor to r^6 by Horner, for a float or a vector of them (T{} + c broadcasts c);
// the scalar and vector 2^x below share it, so both round alike.
template <typename T>
__attribute__((always_inline)) inline T exp_taylor6(T r) {
  T p = T{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

// out[x] = acc[x] / sum rounded to T (0 where the softmax sum is 0: a row that saw no key); the end of every
// attention pass (general.h, prefill.h).
template <typename T>
inline void store_normalized(T* dst, const float* acc, float sum, int d) {
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  for (int x = 0; x < d; ++x) {
    const float o = acc[x] * inv;
    if constexpr (sizeof(T) == sizeof(float))
      dst[x] = o;
    else
      dst[x] = float_to_bf16(o);
  }
}

// 2^x for x <= 0, written with arithmetic and bit operations only so that loops
// over it vectorize: x = n + f with |f| <= 0.5, 2^f by its Taylor series in
// f*ln2 to degree 6 (relative error ~1e-7), 2^n through the exponent bits.
__attribute__((always_inline)) inline float exp2_neg(float x) {
  x = std::max(x, -126.0f);
  const float n = std::nearbyint(x);
  const float p = exp_taylor6(static_cast<float>((x - n) * kLn2));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// 2^x lane by lane, the polynomial of exp2_neg; lanes below -126 (masked keys are -inf) give exactly 0.
inline vfloat exp2_neg_vec(vfloat x) {
  const vfloat lo = splat(-126.0f);
  const vint keep = x > lo;
  x = keep ? x : lo;
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to nearest
  const vfloat n = (x + magic) - magic;
  const vfloat p = exp_taylor6(static_cast<vfloat>((x - n) * kLn2));
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return keep ? p * scale : vfloat{};
}

template <typename T>
inline float to_float(T x);
template <>
inline float to_float<float>(float x) { return x; }
template <>
inline float to_float<uint16_t>(uint16_t x) { return bf16_to_float(x); }

}  // namespace
