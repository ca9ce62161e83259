// The GGUF block formats the quantized linears read (Q8_0, Q4_0, Q4_1: core/model/quant_formats.py has the byte
// layouts), their in-register de-quantization and the arguments of one call: shared by quant_linear.h's float
// path and quant_int8.h's integer path.

#pragma once

#include "llama_block.h"  // linear.h's weight formats, the layer helpers and the vector layer

namespace {
namespace pagedkv_quant {

constexpr int kQBlock = 32;                          // values a block, every format here
constexpr int kQChunks = kQBlock / kLanes;           // vectors a block
constexpr int kQRows = kRegisters >= 32 ? 6 : 4;     // activation rows of a tile at most
constexpr int kQColBlock = 16;                       // weight rows a thread finishes before moving on
constexpr int qcols(int rows) {                      // weight rows of a tile of `rows` activation rows
  return kRegisters >= 32 ? (rows <= 2 ? 8 : 4) : (rows <= 2 ? 4 : 2);
}
static_assert(kQBlock % kLanes == 0 && kLanes <= 16, "a chunk lies in one half of a nibble block");

// kLanes nibbles of the bytes at p (the high ones or the low ones) widened to floats: one load, a shift and a mask
// of bytes, one zero-extension and one int->float conversion a vector on AVX2 / AVX-512. (GCC's generic vector
// code moves byte vectors through general registers lane by lane: 20x slower, measured.) Signed bytes (Q8_0) go
// through simd.h's load_row<int8_t>.
inline vfloat widen_nibbles(const uint8_t* p, bool high) {
#if defined(__AVX512F__) && !defined(PAGEDKV_AVX512_SHAPE)
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  b = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15));
  return reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)));
#elif defined(__AVX2__) && !defined(PAGEDKV_AVX512_SHAPE)
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  b = _mm_and_si128(high ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(15));
  return reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
#else
  vfloat f;
  for (int l = 0; l < kLanes; ++l) f[l] = static_cast<float>(high ? p[l] >> 4 : p[l] & 15);
  return f;
#endif
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    const float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (exp == 0x1f ? 0x7f800000u : (exp + 112u) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// One format: its block size, the scale and offset of a block, and chunk j of its values as floats.
template <int F>
struct Format;

template <>
struct Format<0> {  // Q8_0: d, 32 int8
  static constexpr int kBytes = 34;
  static void scales(const uint8_t* b, float& d, float& m) { d = half_to_float(b), m = 0.0f; }
  static vfloat chunk(const uint8_t* b, int j, float d, float) {
    return load_row<int8_t>(reinterpret_cast<const int8_t*>(b + 2 + j * kLanes)) * d;
  }
};

// The nibble formats: value i of a block in the low nibble of byte i (i < 16), value i + 16 in its high one.
template <int kOffset>
inline vfloat nibbles(const uint8_t* b, int j, float d, float m) {
  const int e0 = j * kLanes;
  return widen_nibbles(b + kOffset + (e0 & 15), e0 >= 16) * d + m;
}

template <>
struct Format<1> {  // Q4_0: d, 16 nibble bytes; value d (q - 8) = q d + (-8 d)
  static constexpr int kBytes = 18;
  static void scales(const uint8_t* b, float& d, float& m) { d = half_to_float(b), m = -8.0f * d; }
  static vfloat chunk(const uint8_t* b, int j, float d, float m) { return nibbles<2>(b, j, d, m); }
};

template <>
struct Format<2> {  // Q4_1: d, m, 16 nibble bytes; value q d + m
  static constexpr int kBytes = 20;
  static void scales(const uint8_t* b, float& d, float& m) { d = half_to_float(b), m = half_to_float(b + 2); }
  static vfloat chunk(const uint8_t* b, int j, float d, float m) { return nibbles<4>(b, j, d, m); }
};

struct Args {
  const float* x;
  int64_t rows;
  int k;
  int64_t ldx;  // x's row stride
  const uint8_t* w;
  int64_t row_bytes;
  int n;
  float* y;
  int64_t ldy;      // y's row stride
  bool accumulate;  // y += instead of y =
};

}  // namespace pagedkv_quant
}  // namespace
