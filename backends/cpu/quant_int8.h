// The integer path of quant_linear.h (x86 builds with AVX2; pagedkv_cpu_quant_linear_int8, not what the model
// runs: it measured slower than the float path and missed issue 44's agreement goal, benchmarks/JOURNAL.md): the
// activations are quantized once a call to int8,
// a scale per 32-value block (d_x = max|x| / 127, q_x = round(x / d_x)), and each (activation block, weight block)
// pair is one integer dot product of the weight's bytes or nibbles with q_x, then one float fma:
//   Q8_0: d_w d_x sum(q_w q_x)
//   Q4_0: d_w d_x (sum(q_w q_x) - 8 sum(q_x))       (nibbles q_w in 0..15, value d_w (q_w - 8))
//   Q4_1: d_w d_x sum(q_w q_x) + m_w d_x sum(q_x)  (value d_w q_w + m_w)
// so the offset terms need only the block's d_x sum(q_x), computed with q_x. The dot is vpdpbusd (u8 x s8 -> s32)
// where the build has it (avx512_vnni with avx512vl on 256-bit registers, or avx_vnni), else vpmaddubsw + vpmaddwd
// (no overflow: |q_w| <= 128, |q_x| <= 127, so a pair sums to at most 32512 < 2^15). Q8_0's signed weights go in as
// |q_w| and q_x with q_w's sign (vpsignb), as the instruction takes one unsigned operand.
//
// Why: the float path widens every weight to fp32 and spends a multiply-add per weight per activation row; here
// 32 weights cost one or two integer instructions. The result differs from the float path by the activations'
// rounding (at most d_x / 2 a value: tests/backends/cpu/test_cpu_quant_linear.py derives the bound), as in
// llama.cpp's CPU kernels; issue 44's accuracy goals are checked by benchmarks/e2e/gguf_quant_accuracy.py.
//
// Tile: R activation rows x C weight rows, one 8-lane float accumulator each (AVX2: 16 registers, R x C <= 8;
// AVX-512 builds use the same 256-bit code with R x C <= 16 of their 32 registers). Threads and column blocks as
// in quant_linear.h.

#pragma once

#include "quant_blocks.h"  // Args, the block formats

#if defined(__AVX2__) && !defined(PAGEDKV_AVX512_SHAPE)
#define PAGEDKV_QUANT_INT8 1

namespace {
namespace pagedkv_quant_int8 {

using pagedkv_quant::Args;
using pagedkv_quant::Format;

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr const char* kPath = "int8 avx512-vnni";
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
constexpr const char* kPath = "int8 avx-vnni";
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
constexpr const char* kPath = "int8 maddubs";
inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

constexpr int kBlock = 32;
constexpr int kRows = kRegisters >= 32 ? 4 : 2;  // activation rows of a tile at most
constexpr int kCols = 4;                         // weight rows of a tile
constexpr int kColBlock = 16;

// The quantized activations of a call: q [rows, k] int8, and per block d_x and d_x sum(q_x).
struct Acts {
  const int8_t* q;
  const float* d;
  const float* ds;
  int64_t blocks;  // a row's
};

// One row's blocks: every value's error |x - d q| <= d / 2 (round to nearest), d = max|x| / 127 of its block.
inline void quantize_row(const float* x, int64_t blocks, int8_t* q, float* d, float* ds) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float step = amax / 127.0f, inv = step > 0.0f ? 1.0f / step : 0.0f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = step;
    ds[b] = step * static_cast<float>(sum);
  }
}

// A weight block's 32 values as bytes in value order: Q8_0's signed bytes, or the nibbles (value i < 16 in byte
// i's low nibble, i + 16 in its high one), and its scale and offset factor.
template <int F>
inline __m256i weight_bytes(const uint8_t* blk) {
  if constexpr (F == 0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == 1 ? 2 : 4)));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// sum over the block of q_w q_x, as 8 int32 lanes
template <int F>
inline __m256i block_dot(__m256i w, __m256i x) {
  if constexpr (F == 0) return dot_add(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return dot_add(_mm256_setzero_si256(), w, x);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

template <int F, int R, int C>
inline void tile(const Args& a, const Acts& x, int64_t r0, int n0) {
  __m256 acc[R][C];
  float off[R][C] = {};  // the offset terms: sum over blocks of m_w d_x sum(q_x) (Q4_0: m_w = -8 d_w)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint8_t* w = a.w + n0 * a.row_bytes;
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i xq[R];
    for (int r = 0; r < R; ++r)
      xq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (r0 + r) * a.k + b * kBlock));
    for (int c = 0; c < C; ++c) {
      const uint8_t* blk = w + c * a.row_bytes + b * Format<F>::kBytes;
      float dw, mw;
      Format<F>::scales(blk, dw, mw);
      const __m256i wv = weight_bytes<F>(blk);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * x.blocks + b;
        const __m256 dot = _mm256_cvtepi32_ps(block_dot<F>(wv, xq[r]));
        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[i]), dot, acc[r][c]);
        if constexpr (F != 0) off[r][c] += mw * x.ds[i];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float& out = a.y[(r0 + r) * a.ldy + n0 + c];
      const float v = hsum(acc[r][c]) + off[r][c];
      out = a.accumulate ? out + v : v;
    }
}

template <int F, int R>
inline void tiles(const Args& a, const Acts& x, int64_t r0, int n0, int n1) {
  int n = n0;
  for (; n + kCols <= n1; n += kCols) tile<F, R, kCols>(a, x, r0, n);
  for (; n < n1; ++n) tile<F, R, 1>(a, x, r0, n);
}

template <int F, int... R>
inline void tail_tiles(int rows, std::integer_sequence<int, R...>, const Args& a, const Acts& x, int64_t r0, int n0,
                       int n1) {
  ((rows == R + 1 ? tiles<F, R + 1>(a, x, r0, n0, n1) : void()), ...);
}

template <int F>
void run(const Args& a, const Acts& x, int threads) {
  const int units = (a.n + kColBlock - 1) / kColBlock;
  threads = std::max(1, std::min(threads, units));
#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    const int first = static_cast<int>(static_cast<int64_t>(units) * t / threads);
    const int last = static_cast<int>(static_cast<int64_t>(units) * (t + 1) / threads);
    for (int u = first; u < last; ++u) {
      const int n0 = u * kColBlock, n1 = std::min(a.n, n0 + kColBlock);
      int64_t r0 = 0;
      for (; r0 + kRows <= a.rows; r0 += kRows) tiles<F, kRows>(a, x, r0, n0, n1);
      if (r0 < a.rows)
        tail_tiles<F>(static_cast<int>(a.rows - r0), std::make_integer_sequence<int, kRows - 1>{}, a, x, r0, n0, n1);
    }
  }
}

// The quant_rows of quant_linear.h by this path: quantizes x into per-thread scratch (kept between calls).
inline void rows(int format, const Args& a, int threads) {
  static thread_local std::vector<int8_t> q;
  static thread_local std::vector<float> scales;
  const int64_t blocks = a.k / kBlock;
  q.resize(static_cast<size_t>(a.rows * a.k));
  scales.resize(static_cast<size_t>(2 * a.rows * blocks));
  // pointers taken here: inside the parallel region `q` would name each worker's own (empty) scratch
  int8_t* qx = q.data();
  float* d = scales.data();
  float* ds = d + a.rows * blocks;
#pragma omp parallel for schedule(static) num_threads(threads) if (a.rows >= 8)
  for (int64_t r = 0; r < a.rows; ++r)
    quantize_row(a.x + r * a.ldx, blocks, qx + r * a.k, d + r * blocks, ds + r * blocks);
  const Acts x{qx, d, ds, blocks};
  if (format == 0) run<0>(a, x, threads);
  if (format == 1) run<1>(a, x, threads);
  if (format == 2) run<2>(a, x, threads);
}

}  // namespace pagedkv_quant_int8
}  // namespace
#endif
