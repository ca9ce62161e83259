// The GGUF block formats the quantized linears read (Q8_0, Q4_0, Q4_1: core/model/quant_formats.py has the byte
// layouts), fp16 scales and the arguments of one call: shared by quant_linear.h's float path (over the repacked
// layout of quant_packed.h) and quant_int8.h's integer path (over the file's layout).

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

// One format as the file holds it (quant_int8.h reads that layout): its block size, the scale and offset of a block.
template <int F>
struct Format;

template <>
struct Format<0> {  // Q8_0: d, 32 int8
  static constexpr int kBytes = 34;
  static void scales(const uint8_t* b, float& d, float& m) { d = half_to_float(b), m = 0.0f; }
};

template <>
struct Format<1> {  // Q4_0: d, 16 nibble bytes; value d (q - 8) = q d + (-8 d)
  static constexpr int kBytes = 18;
  static void scales(const uint8_t* b, float& d, float& m) { d = half_to_float(b), m = -8.0f * d; }
};

template <>
struct Format<2> {  // Q4_1: d, m, 16 nibble bytes; value q d + m
  static constexpr int kBytes = 20;
  static void scales(const uint8_t* b, float& d, float& m) { d = half_to_float(b), m = half_to_float(b + 2); }
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
