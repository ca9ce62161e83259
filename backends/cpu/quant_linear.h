// y = x W^T for fp32 activations x and a weight W kept in a GGUF block format (quantization gguf): Q8_0, Q4_0,
// Q4_1 (core/model/quant_formats.py has the byte layouts). Included by attention.cpp after the other kernels; it
// uses simd.h's vector layer (kLanes floats a vector, add_lanes).
//
// Why: a decode step at small batch is bound by the bytes of the weights it reads, and these blocks are 4.5-8.5
// bits a weight where fp32 is 32. The weights stay in the file's layout (row after row of 32-value blocks, no
// repacking, so the resident weights are the file's size) and are de-quantized in registers: each kLanes-value
// chunk of a block is widened to floats (int8 sign-extended, or a nibble masked), scaled (q * d + m, one fused
// multiply-add; Q4_0's m is -8 d, Q8_0's is 0) and used at once by every activation row of the tile.
//
// Tile: R activation rows x C weight rows, R x C accumulator vectors (one per output, reduced across lanes at
// the end), one de-quantized weight vector with its scale and offset, and one activation vector in registers
// (AVX-512, 32 registers: R <= 6, C = 8 for 1-2 rows, 4 for more; AVX2, 16 registers: R <= 4, C = 4 or 2). Threads take equal contiguous ranges of
// kQColBlock weight rows; within a range, each block of kQColBlock weight rows (16 rows of Q4_1 at k = 1536 are
// 15 KB: L1) is used by every row tile of x before the next is read, so memory streams each weight byte once.
// Sums are fp32 fused multiply-adds in k order per lane, so results differ from a float64 product of the
// de-quantized weights by rounding only (tests/backends/cpu/test_cpu_quant_linear.py).

#pragma once

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

// y[r0 + r, n0 + c] for r < R, c < C: one register tile over every block of the C weight rows.
template <int F, int R, int C>
inline void tile(const Args& a, int64_t r0, int n0) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vfloat{};
  const float* x = a.x + r0 * a.ldx;
  const uint8_t* w = a.w + n0 * a.row_bytes;
  for (int b = 0; b < a.k / kQBlock; ++b) {
    // column by column: one weight vector, its scale and offset live at a time (holding all C would spill the
    // accumulators); the activation vectors are reloaded from L1 for each column
    for (int c = 0; c < C; ++c) {
      const uint8_t* blk = w + c * a.row_bytes + b * Format<F>::kBytes;
      float d, m;
      Format<F>::scales(blk, d, m);
      for (int j = 0; j < kQChunks; ++j) {
        const vfloat wv = Format<F>::chunk(blk, j, d, m);
        for (int r = 0; r < R; ++r) acc[r][c] += load(x + r * a.ldx + b * kQBlock + j * kLanes) * wv;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float& out = a.y[(r0 + r) * a.ldy + n0 + c];
      out = a.accumulate ? out + add_lanes(acc[r][c]) : add_lanes(acc[r][c]);
    }
}

// Weight rows [n0, n1) against activation rows [r0, r0 + R): C-row tiles, then single rows for the rest.
template <int F, int R>
inline void tiles(const Args& a, int64_t r0, int n0, int n1) {
  constexpr int C = qcols(R);
  int n = n0;
  for (; n + C <= n1; n += C) tile<F, R, C>(a, r0, n);
  for (; n < n1; ++n) tile<F, R, 1>(a, r0, n);
}

template <int F, int... R>
inline void tail_tiles(int rows, std::integer_sequence<int, R...>, const Args& a, int64_t r0, int n0, int n1) {
  ((rows == R + 1 ? tiles<F, R + 1>(a, r0, n0, n1) : void()), ...);
}

template <int F>
void run(const Args& a, int threads) {
  const int units = (a.n + kQColBlock - 1) / kQColBlock;
  for_ranges_dynamic(units, threads, [&](int first, int last) {  // linear.h: a descheduled thread stalls no step
    for (int u = first; u < last; ++u) {
      const int n0 = u * kQColBlock, n1 = std::min(a.n, n0 + kQColBlock);
      int64_t r0 = 0;
      for (; r0 + kQRows <= a.rows; r0 += kQRows) tiles<F, kQRows>(a, r0, n0, n1);
      if (r0 < a.rows)
        tail_tiles<F>(static_cast<int>(a.rows - r0), std::make_integer_sequence<int, kQRows - 1>{}, a, r0, n0, n1);
    }
  });
}

constexpr int kFormats = 3;
constexpr int64_t kBlockBytes[kFormats] = {Format<0>::kBytes, Format<1>::kBytes, Format<2>::kBytes};

// y[rows, n] (+)= x[rows, k] W^T, x's rows ldx apart and y's ldy; false for a format or sizes it does not take.
inline bool quant_rows(int format, const float* x, int64_t ldx, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                       float* y, int64_t ldy, bool accumulate, int threads) {
  if (format < 0 || format >= kFormats || rows < 0 || k <= 0 || k % kQBlock != 0 || n <= 0 || k > INT32_MAX / 4 ||
      n > INT32_MAX)
    return false;
  const Args a{x, rows, static_cast<int>(k), ldx, w, k / kQBlock * kBlockBytes[format], static_cast<int>(n), y, ldy,
               accumulate};
  threads = std::max(1, threads);
  if (format == 0) run<0>(a, threads);
  if (format == 1) run<1>(a, threads);
  if (format == 2) run<2>(a, threads);
  return true;
}

}  // namespace pagedkv_quant
}  // namespace

extern "C" {

// y[rows, n] = x[rows, k] W^T, W [n, k] in GGUF blocks (format 0: Q8_0, 1: Q4_0, 2: Q4_1), k / 32 blocks a row of
// W, x and y contiguous. Returns 0, or 1 for a format or sizes it does not take.
int pagedkv_cpu_quant_linear(int format, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                             float* y, int threads) {
  return pagedkv_quant::quant_rows(format, x, k, rows, k, w, n, y, n, false, threads) ? 0 : 1;
}

// pagedkv_cpu_llama_attention_inputs (attention.cpp) on GGUF-block weights: formats[i] / weights[i] are Wq, Wk, Wv;
// qkv [rows, nq + 2 nkv] with q and k rotated; xn [min(rows, kRowChunk), d] scratch.
int pagedkv_cpu_quant_llama_attention_inputs(const float* h, int64_t rows, int64_t d, const float* norm_weight,
                                             float eps, const int* formats, const uint8_t* const* weights, int64_t nq,
                                             int64_t nkv, int64_t head_dim, const float* cos, const float* sin,
                                             float* xn, float* qkv, int threads) {
  if (rows < 0 || d <= 0 || nq <= 0 || nkv <= 0 || head_dim <= 0 || head_dim % 2 != 0 || nq % head_dim != 0 ||
      nkv % head_dim != 0 || d > INT32_MAX / 4 || nq + 2 * nkv > INT32_MAX)
    return 1;
  threads = std::max(1, threads);
  const int64_t width = nq + 2 * nkv, offsets[3] = {0, nq, nq + nkv}, outs[3] = {nq, nkv, nkv};
  const int dim = static_cast<int>(head_dim), rotated = static_cast<int>((nq + nkv) / head_dim);
  for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
    const int64_t n = std::min<int64_t>(kRowChunk, rows - r0);
    float* out = qkv + r0 * width;
    rms_norm_rows(h + r0 * d, n, static_cast<int>(d), norm_weight, eps, xn, threads);
    for (int i = 0; i < 3; ++i)
      if (!pagedkv_quant::quant_rows(formats[i], xn, d, n, d, weights[i], outs[i], out + offsets[i], width, false,
                                     threads))
        return 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= kParallelRows)
    for (int64_t t = 0; t < n; ++t)
      rotate_heads(out + t * width, rotated, dim, cos + (r0 + t) * dim, sin + (r0 + t) * dim);
  }
  return 0;
}

// pagedkv_cpu_llama_mlp (attention.cpp) on GGUF-block weights: formats[i] / weights[i] are Wo, Wg, Wu, Wd; h is
// updated in place; xn [min(rows, kRowChunk), d] and gu [min(rows, kRowChunk), 2 inter] are scratch.
int pagedkv_cpu_quant_llama_mlp(float* h, int64_t rows, int64_t d, const float* attn, int64_t nq,
                                const float* norm_weight, float eps, int64_t inter, const int* formats,
                                const uint8_t* const* weights, float* xn, float* gu, int threads) {
  if (rows < 0 || d <= 0 || nq <= 0 || inter <= 0 || d > INT32_MAX / 4 || nq > INT32_MAX / 4 ||
      inter > INT32_MAX / 4)
    return 1;
  threads = std::max(1, threads);
  using pagedkv_quant::quant_rows;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {  // a chunk's activations stay in cache, as in llama_block.h
    const int64_t n = std::min<int64_t>(kRowChunk, rows - r0);
    float* hc = h + r0 * d;
    if (!quant_rows(formats[0], attn + r0 * nq, nq, n, nq, weights[0], d, hc, d, true, threads)) return 1;
    rms_norm_rows(hc, n, static_cast<int>(d), norm_weight, eps, xn, threads);
    if (!quant_rows(formats[1], xn, d, n, d, weights[1], inter, gu, 2 * inter, false, threads) ||
        !quant_rows(formats[2], xn, d, n, d, weights[2], inter, gu + inter, 2 * inter, false, threads))
      return 1;
    silu_mul_rows(gu, n, static_cast<int>(inter), threads);
    if (!quant_rows(formats[3], gu, 2 * inter, n, inter, weights[3], d, hc, d, true, threads)) return 1;
  }
  return 0;
}

}  // extern "C"
