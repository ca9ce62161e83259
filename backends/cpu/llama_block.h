// The dense parts of a Llama decoder layer, around its attention, in two calls (fp32 or bf16 activations, fp32 or
// bf16 weights in linear.h's formats, CPU):
//
//   attention inputs: xn = RMSNorm(h); [q k v] = xn [Wq; Wk; Wv]^T; rotary on q and k
//   MLP block:        h += attn Wo^T; xn = RMSNorm(h); h += (SiLU(xn Wg^T) * xn Wu^T) Wd^T
//
// In between, the engine attends through the backend interface as for every model (k and v written to the paged
// cache by the first call where it can, by the backend's KV write otherwise). Done op by op in torch, these parts
// are some 50 aten calls a layer (a large share of a small model's decode step, docs/cpu_kernels.md); here they are
// two calls, and q/k/v and gate/up are each one product over one packed weight ([Wq; Wk; Wv] and [Wg; Wu] stacked).
// The arithmetic is transformers' up to rounding (sums in another order, fused multiply-adds, the SiLU's
// exp from a polynomial within 2 ulp). For llama_layer.cpp.

#pragma once

#include "linear.h"

namespace {

// Rows are independent: split them over the threads only when there are enough to be worth a fork.
constexpr int64_t kParallelRows = 16;

inline void rms_norm_rows(const float* h, int64_t rows, int d, const float* weight, float eps, float* out,
                          int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= kParallelRows)
  for (int64_t t = 0; t < rows; ++t) {
    const float* x = h + t * d;
    float* y = out + t * d;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < d; ++i) squares += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
#pragma omp simd
    for (int i = 0; i < d; ++i) y[i] = weight[i] * (x[i] * inv);
  }
}

// Rotate the heads of one row in place: x[i] cos[i] - x[i + D/2] sin[i] and x[i + D/2] cos[i + D/2] + x[i]
// sin[i + D/2] (transformers' rotate_half; cos and sin are the row's full head_dim wide tables).
inline void rotate_heads(float* x, int heads, int head_dim, const float* cos, const float* sin) {
  const int half = head_dim / 2;
  for (int h = 0; h < heads; ++h) {
    float* a = x + h * head_dim;
    float* b = a + half;
#pragma omp simd
    for (int i = 0; i < half; ++i) {
      const float lo = a[i], hi = b[i];
      a[i] = lo * cos[i] - hi * sin[i];
      b[i] = hi * cos[half + i] + lo * sin[half + i];
    }
  }
}

// e^x for the SiLU, vectorized: x = n ln2 + r, e^r by Cephes' degree-6 polynomial, 2^n by the exponent bits.
inline vfloat exp_lanes(vfloat x) {
  const vfloat big = splat(88.0f);
  x = x < -big ? -big : x;  // (lane-wise selects: beyond +-88 e^x is out of float range anyway)
  x = x > big ? big : x;
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const vfloat shifted = x * 1.44269504088896341f + magic;
  const vfloat n = shifted - magic;
  const vfloat r = x - n * 0.693359375f - n * -2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vint bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  const vint scale_bits = (bits - 0x4B400000 + 127) << 23;  // n + 127 in the exponent field
  vfloat scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  return p * scale;
}

// gu[t] = [gate | up] (each `inter` wide) -> gu[t][0, inter) = SiLU(gate) * up, in place.
inline void silu_mul_rows(float* gu, int64_t rows, int inter, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= kParallelRows)
  for (int64_t t = 0; t < rows; ++t) {
    float* g = gu + t * 2 * inter;
    const float* u = g + inter;
    int i = 0;
    for (; i + kLanes <= inter; i += kLanes) {
      const vfloat x = load(g + i);
      store(g + i, x / (1.0f + exp_lanes(-x)) * load(u + i));
    }
    for (; i < inter; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

// Activations of type A: fp32 (float), or bf16 (uint16_t) rounded to nearest even when written, as torch's
// .to(torch.bfloat16). The fused calls take them in the model's dtype so that a bf16 layer needs no torch
// conversions around its calls (each a tensor allocation and ~1-2 us of Python, next to a ~30 us call).
template <class A>
inline A from_float(float x) {
  if constexpr (std::is_same_v<A, float>) return x;
  else return float_to_bf16(x);
}
// n values of A as fp32: the values themselves for fp32, else widened into buf.
template <class A>
inline const float* as_f32(const A* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<A, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = bf16_to_float(src[i]);
    return buf;
  }
}
inline float* as_f32_mut(float* src, int64_t, float*) { return src; }
inline float* as_f32_mut(uint16_t* src, int64_t n, float* buf) { return const_cast<float*>(as_f32(src, n, buf)); }
template <class A>
inline void put_row(A* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<A>(src[i]);
}

// Where the attention inputs go: without k_cache, out [rows, nq + 2 nkv] (q, k, v of a row side by side); with it,
// out [rows, nq] (q), and the rotated k and the v of row t into slot slots[t] of k_cache / v_cache (rows of nkv
// elements, as the backend's KV write puts them; a slot < 0 is skipped): one call instead of two a layer.
template <class A>
struct QkvSink {
  A* out;
  A* k_cache = nullptr;
  A* v_cache = nullptr;
  const int64_t* slots = nullptr;
  int64_t num_slots = 0;
};

// Floats of scratch a chunk row of llama_attention_inputs needs: xn, then h, the q/k/v sums and the row's cos/sin
// in fp32 (the last three only for bf16 activations or a cache sink; xn alone otherwise).
inline int64_t attention_scratch_floats(int64_t d, int64_t width, int64_t head_dim) {
  return 2 * d + width + 2 * head_dim;
}

// attention inputs: h [rows, d] -> q/k/v [rows, nq + 2 nkv] (q and k rotated by cos/sin [rows, head_dim]) into
// sink, through scratch (attention_scratch_floats per row of min(rows, kRowChunk)); wqkv is [Wq; Wk; Wv] packed
// in format F. Returns 0, or nonzero (nothing written) for sizes it does not take or a slot past num_slots.
template <class F, class A>
inline int llama_attention_inputs(const A* h, int64_t rows, int64_t d, const float* norm_weight, float eps,
                                  const typename F::W* wqkv, int64_t nq, int64_t nkv, int64_t head_dim,
                                  const A* cos, const A* sin, float* scratch, const QkvSink<A>& sink, int threads) {
  if (rows < 0 || d <= 0 || nq <= 0 || nkv <= 0 || head_dim <= 0 || head_dim % 2 != 0 || nq % head_dim != 0 ||
      nkv % head_dim != 0 || d > INT32_MAX / kNr || nq + 2 * nkv > INT32_MAX)
    return 1;
  for (int64_t t = 0; sink.k_cache != nullptr && t < rows; ++t)
    if (sink.slots[t] >= sink.num_slots) return 2;
  threads = std::max(1, threads);
  const int width = static_cast<int>(nq + 2 * nkv), dim = static_cast<int>(head_dim);
  const int rotated = static_cast<int>((nq + nkv) / head_dim);  // q's heads, then k's, side by side in a row
  constexpr bool kF32 = std::is_same_v<A, float>;
  const bool direct = kF32 && sink.k_cache == nullptr;  // sums straight into out
  const int64_t chunk = std::min<int64_t>(rows, kRowChunk);
  float* xn = scratch;
  float* hf = xn + chunk * d;
  float* sums = hf + chunk * d;
  float* tables = sums + chunk * width;  // [chunk][cos | sin]
  std::vector<typename F::X> buf;
  for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {  // (kRowChunk rows at a time, as in the MLP block below)
    const int64_t n = std::min<int64_t>(kRowChunk, rows - r0);
    const float* hc = as_f32(h + r0 * d, n * d, hf);
    float* out = direct ? reinterpret_cast<float*>(sink.out) + r0 * width : sums;
    rms_norm_rows(hc, n, static_cast<int>(d), norm_weight, eps, xn, threads);
    linear_from_f32<F>(xn, d, n, d, wqkv, nullptr, width, out, false, threads, buf);
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= kParallelRows)
    for (int64_t t = 0; t < n; ++t) {
      float* row = out + t * width;
      if constexpr (kF32) {
        rotate_heads(row, rotated, dim, cos + (r0 + t) * dim, sin + (r0 + t) * dim);
      } else {
        float* c = tables + t * 2 * dim;
        for (int i = 0; i < dim; ++i) c[i] = bf16_to_float(cos[(r0 + t) * dim + i]);
        for (int i = 0; i < dim; ++i) c[dim + i] = bf16_to_float(sin[(r0 + t) * dim + i]);
        rotate_heads(row, rotated, dim, c, c + dim);
      }
      if (direct) continue;
      const int64_t slot = sink.k_cache == nullptr ? -1 : sink.slots[r0 + t];
      put_row(sink.out + (r0 + t) * (sink.k_cache == nullptr ? width : nq), row, sink.k_cache == nullptr ? width : nq);
      if (slot < 0) continue;
      put_row(sink.k_cache + slot * nkv, row + nq, nkv);
      put_row(sink.v_cache + slot * nkv, row + nq + nkv, nkv);
    }
  }
  return 0;
}

// MLP block: h [rows, d] += attn [rows, nq] Wo^T; xn = RMSNorm(h); gu = xn [Wg; Wu]^T [rows, 2 inter];
// h += (SiLU(gate) * up) Wd^T. h is updated in place; xn [min(rows, kRowChunk), d] and gu [min(rows,
// kRowChunk), 2 inter] are scratch, and for bf16 activations (A = uint16_t) also wide [min(rows, kRowChunk),
// d + nq] (h and attn in fp32; h rounded back once at the end, as torch's copy_ of the fp32 result did); the weights
// are packed in format F.
template <class F, class A>
inline int llama_mlp(A* h, int64_t rows, int64_t d, const A* attn, int64_t nq, const typename F::W* wo,
                     const float* norm_weight, float eps, const typename F::W* wgu, int64_t inter,
                     const typename F::W* wdown, float* xn, float* gu, float* wide, int threads) {
  if (rows < 0 || d <= 0 || nq <= 0 || inter <= 0 || d > INT32_MAX / kNr || nq > INT32_MAX / kNr ||
      inter > INT32_MAX / kNr)
    return 1;
  threads = std::max(1, threads);
  const int dim = static_cast<int>(d), mid = static_cast<int>(inter);
  std::vector<typename F::X> buf;
  // A long input goes through the whole block kRowChunk rows at a time: every weight is read once per
  // kRowChunk rows either way (linear.h), and this way a chunk's gate/up rows (60 x 2 x 1,536 floats for
  // SmolLM2, 737 KB) are still in cache when the SiLU and down_proj read them, instead of a prompt's 25 MB
  // going out to memory and back. Rows are independent, so the result is the same to the bit.
  for (int64_t r0 = 0; r0 < rows; r0 += kRowChunk) {
    const int64_t n = std::min<int64_t>(kRowChunk, rows - r0);
    float* hc = as_f32_mut(h + r0 * d, n * d, wide);
    const float* ac = as_f32(attn + r0 * nq, n * nq, wide + (wide == nullptr ? 0 : n * d));
    linear_from_f32<F>(ac, nq, n, nq, wo, nullptr, dim, hc, true, threads, buf);
    rms_norm_rows(hc, n, dim, norm_weight, eps, xn, threads);
    linear_from_f32<F>(xn, d, n, d, wgu, nullptr, 2 * mid, gu, false, threads, buf);
    silu_mul_rows(gu, n, mid, threads);
    linear_from_f32<F>(gu, 2 * inter, n, inter, wdown, nullptr, dim, hc, true, threads, buf);
    if constexpr (!std::is_same_v<A, float>) put_row(h + r0 * d, hc, n * d);
  }
  return 0;
}

}  // namespace
