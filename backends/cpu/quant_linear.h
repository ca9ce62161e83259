// y = x W^T for fp32 activations x and a weight W in a GGUF block format (quantization gguf): Q8_0, Q4_0, Q4_1,
// repacked at load into quant_packed.h's layout (groups of kGroup weight rows, values and fp16 scales apart, the
// file's size). Included by attention.cpp after the other kernels; it uses simd.h's vector layer.
//
// Why: a decode step at small batch is bound by the bytes of the weights it reads, and these blocks are 4.5-8.5
// bits a weight where fp32 is 32. They are de-quantized in registers: a row's block is widened to kQChunks float
// vectors of its quantized values (quant_packed.h's values), each scaled (q d + m, one fused multiply-add; Q4_0's
// m is -8 d, Q8_0's 0) and used at once by every activation row of the tile. The tile's C scales of a block are
// converted together, once a block (the file layout converted one per row and block, and loaded the values
// unaligned: the kernel ran at ~7 GB/s of weights against ~40 GB/s for fp32, compute-bound; benchmarks/JOURNAL.md).
//
// Tile: R activation rows x C weight rows of one group, R x C accumulator vectors (one per output, reduced across
// lanes at the end) and one block's value vectors in registers (AVX-512, 32 registers: R <= 6, C = 8 for 1-2 rows,
// 4 for more; AVX2, 16 registers: R <= 4, C = 4 or 2). Threads take equal contiguous ranges of kQColBlock weight
// rows (two groups); within a range, each block of kQColBlock weight rows is used by every row tile of x before
// the next is read, so memory streams each weight byte once. Sums are fp32 fused multiply-adds in k order per
// lane, so results differ from a float64 product of the de-quantized weights by rounding only
// (tests/backends/cpu/test_cpu_quant_linear.py).

#pragma once

#include "quant_packed.h"  // the repacked layout, its values and scales (and quant_blocks.h's Args)

namespace {
namespace pagedkv_quant {

static_assert(kQColBlock % kGroup == 0 && kGroup % qcols(1) == 0 && kGroup % qcols(kQRows) == 0,
              "tiles lie in one group and ranges start on a group");

// The C scales and offsets of block b of tile columns [c0, c0 + C) of group g.
template <int F, int C>
inline void block_scales(const Group& g, int64_t b, int c0, float* d, float* m) {
  halves<C>(g.d + (b * g.width + c0) * 2, d);
  if constexpr (Packed<F>::kOffset) {
    halves<C>(g.m + (b * g.width + c0) * 2, m);
  } else {
    for (int c = 0; c < C; ++c) m[c] = F == 1 ? -8.0f * d[c] : 0.0f;
  }
}

// y[r0 + r, n0 + c] for r < R, c < C: one register tile over every block of columns [c0, c0 + C) of group g, whose
// first weight row is n0.
template <int F, int R, int C>
inline void tile(const Args& a, const Group& g, int c0, int64_t r0, int n0) {
  vfloat acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vfloat{};
  const float* x = a.x + r0 * a.ldx;
  const int64_t blocks = a.k / kQBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    float d[C], m[C];
    block_scales<F, C>(g, b, c0, d, m);
    // 1-2 rows: through memory, so each use is a broadcast load (a load port) instead of a register shuffle (the
    // shuffle ports also widen and look up the values): +15-25% at batch 1; with more rows it cost 30% (JOURNAL)
    if constexpr (R <= 2) asm volatile("" : "+m"(d), "+m"(m));
    const uint8_t* q = g.q + (b * g.width + c0) * Packed<F>::kQBytes;
    for (int c = 0; c < C; ++c) {  // one row's values live at a time (all C would spill the accumulators)
      vfloat v[kQChunks];
      values<F>(q + c * Packed<F>::kQBytes, v);
      if constexpr (F == 0 && R == 1) {  // Q8_0 at one row: the block's sum of x q, scaled once (one fma fewer)
        vfloat part = v[0] * load(x + b * kQBlock);
        for (int j = 1; j < kQChunks; ++j) part += v[j] * load(x + b * kQBlock + j * kLanes);
        acc[0][c] += part * d[c];
        continue;
      }
      for (int j = 0; j < kQChunks; ++j) {
        const vfloat wv = F == 0 ? v[j] * d[c] : v[j] * d[c] + m[c];
        for (int r = 0; r < R; ++r) acc[r][c] += load(x + r * a.ldx + b * kQBlock + j * kLanes) * wv;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float& out = a.y[(r0 + r) * a.ldy + n0 + c0 + c];
      out = a.accumulate ? out + add_lanes(acc[r][c]) : add_lanes(acc[r][c]);
    }
}

// Weight rows [n0, n1) (n0 a multiple of kGroup) against activation rows [r0, r0 + R): group by group, C-row tiles,
// then single rows for the rest of a narrower last group.
template <int F, int R>
inline void tiles(const Args& a, int64_t r0, int n0, int n1) {
  constexpr int C = qcols(R);
  for (int n = n0; n < n1; n += kGroup) {
    const Group g = group<F>(a, n / kGroup);
    int c = 0;
    for (; c + C <= g.width; c += C) tile<F, R, C>(a, g, c, r0, n);
    for (; c < g.width; ++c) tile<F, R, 1>(a, g, c, r0, n);
  }
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

}  // namespace pagedkv_quant
}  // namespace

#include "quant_int8.h"  // the integer path (activations quantized to int8), on builds with AVX2

namespace {
namespace pagedkv_quant {

#if defined(PAGEDKV_QUANT_INT8)
constexpr const char* kInt8Path = pagedkv_quant_int8::kPath;
#else
constexpr const char* kInt8Path = "none";
#endif

// y[rows, n] (+)= x[rows, k] W^T, x's rows ldx apart and y's ldy; false for a format or sizes it does not take (or
// int8, the integer path, on a build without it).
inline bool quant_rows(int format, const float* x, int64_t ldx, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                       float* y, int64_t ldy, bool accumulate, int threads, bool int8 = false) {
  if (format < 0 || format >= kFormats || rows < 0 || k <= 0 || k % kQBlock != 0 || n <= 0 || k > INT32_MAX / 4 ||
      n > INT32_MAX)
    return false;
  const Args a{x, rows, static_cast<int>(k), ldx, w, k / kQBlock * kBlockBytes[format], static_cast<int>(n), y, ldy,
               accumulate};
  threads = std::max(1, threads);
  if (int8) {
#if defined(PAGEDKV_QUANT_INT8)
    pagedkv_quant_int8::rows(format, a, threads);
    return true;
#else
    return false;
#endif
  }
  if (format == 0) run<0>(a, threads);
  if (format == 1) run<1>(a, threads);
  if (format == 2) run<2>(a, threads);
  return true;
}

}  // namespace pagedkv_quant
}  // namespace

extern "C" {

// This build's integer path (quant_int8.h): "int8 <dot instruction>", or "none". It is not what the model runs:
// it measured slower than the float path here and missed issue 44's agreement goal (benchmarks/JOURNAL.md).
const char* pagedkv_cpu_quant_int8_path() { return pagedkv_quant::kInt8Path; }

// pagedkv_cpu_quant_linear by the integer path: the activations rounded to int8 per 32-block, W in the file's
// layout (not repacked). Returns 0, or 1 for a format or sizes it does not take or a build without the path.
int pagedkv_cpu_quant_linear_int8(int format, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t n,
                                  float* y, int threads) {
  return pagedkv_quant::quant_rows(format, x, k, rows, k, w, n, y, n, false, threads, true) ? 0 : 1;
}

// y[rows, n] = x[rows, k] W^T, W [n, k] in GGUF blocks (format 0: Q8_0, 1: Q4_0, 2: Q4_1) repacked as quant_packed.h
// says, k / 32 blocks a row of W, x and y contiguous. Returns 0, or 1 for a format or sizes it does not take.
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
