// The repacked layout of a GGUF-block weight that quant_linear.h's float path reads (made once at load by
// core/model/quant_packing.py, which has the byte layout and the exact round trip): weight rows in groups of
// kGroup (the last group may be narrower), and within a group of `width` rows, in order,
//   q:  blocks x width x kQBytes   the block's quantized values, row after row for each block (Q8_0: 32 int8;
//                                  Q4_0 / Q4_1: the file's 16 nibble bytes, value i low in byte i, i + 16 high)
//   d:  blocks x width fp16        the scales
//   m:  blocks x width fp16        (Q4_1) the offsets
// so a group takes width x row_bytes bytes: the resident size is the file's, byte for byte.
//
// Why: in the file a block is 34 / 18 / 20 bytes with its fp16 scale in front, so the kernel's value loads were
// unaligned and each block's scale was converted alone per weight row. Here a row's 16 or 32 value bytes of a block
// are 16-byte aligned (every group starts on a multiple of 8 x block bytes, itself a multiple of 16), the tile's
// kGroup scales of a block are one 16-byte load and one conversion (vcvtph2ps), and the value bytes of the C rows of
// a tile are adjacent, so each block of a tile streams one contiguous run of memory.

#pragma once

#include "quant_blocks.h"  // kQBlock, kLanes, half_to_float, Args

namespace {
namespace pagedkv_quant {

constexpr int kGroup = 8;  // weight rows a group (core/model/quant_packing.py's GROUP)

template <int F>
struct Packed;
template <>
struct Packed<0> {  // Q8_0
  static constexpr int kQBytes = 32;
  static constexpr bool kOffset = false;
};
template <>
struct Packed<1> {  // Q4_0: value d (q - 8), an offset of -8 d
  static constexpr int kQBytes = 16;
  static constexpr bool kOffset = false;
};
template <>
struct Packed<2> {  // Q4_1: value d q + m
  static constexpr int kQBytes = 16;
  static constexpr bool kOffset = true;
};

// Group g of a packed weight: its value bytes, scales and offsets and its row count.
struct Group {
  const uint8_t* q;
  const uint8_t* d;
  const uint8_t* m;
  int width;
};

template <int F>
inline Group group(const Args& a, int g) {
  const int width = std::min(kGroup, a.n - g * kGroup);
  const int64_t blocks = a.k / kQBlock;
  const uint8_t* q = a.w + static_cast<int64_t>(g) * kGroup * a.row_bytes;
  const uint8_t* d = q + blocks * width * Packed<F>::kQBytes;
  return {q, d, d + blocks * width * 2, width};
}

// C consecutive fp16 values at p as floats: one conversion instruction for 2, 4 or 8 where the build has F16C.
template <int C>
inline void halves(const uint8_t* p, float* out) {
#if defined(__F16C__)
  if constexpr (C == 8) {
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    return;
  }
  if constexpr (C == 4) {
    _mm_storeu_ps(out, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return;
  }
  if constexpr (C == 2) {
    int32_t bits;
    std::memcpy(&bits, p, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    out[0] = _mm_cvtss_f32(f), out[1] = _mm_cvtss_f32(_mm_movehdup_ps(f));
    return;
  }
#endif
  for (int c = 0; c < C; ++c) out[c] = half_to_float(p + 2 * c);
}

// The kQChunks vectors of one row's block of quantized values q (not yet scaled), in value order: Q8_0's int8
// sign-extended; the nibbles 0..15: the 16 bytes (AVX2: each 8-byte half) widened once to int32 lanes, then masked
// (low nibbles) or shifted (high ones) and converted. (A vpermps lookup in a 16-float table instead of the mask and
// the conversion measured the same: JOURNAL.)
template <int F>
inline void values(const uint8_t* p, vfloat* v) {
  if constexpr (F == 0) {
    for (int j = 0; j < kQChunks; ++j) v[j] = load_row<int8_t>(reinterpret_cast<const int8_t*>(p + j * kLanes));
  } else {
#if defined(__AVX512F__) && !defined(PAGEDKV_AVX512_SHAPE)
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v[0] = reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))));
    v[1] = reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
#elif defined(__AVX2__) && !defined(PAGEDKV_AVX512_SHAPE)
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i lo = _mm256_cvtepu8_epi32(raw), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
    const __m256i mask = _mm256_set1_epi32(15);
    v[0] = reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)));
    v[1] = reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_and_si256(hi, mask)));
    v[2] = reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)));
    v[3] = reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)));
#else
    for (int j = 0; j < kQChunks; ++j)
      for (int l = 0; l < kLanes; ++l) {
        const int e = j * kLanes + l;
        v[j][l] = static_cast<float>(e < 16 ? p[e] & 15 : p[e - 16] >> 4);
      }
#endif
  }
}

}  // namespace pagedkv_quant
}  // namespace
