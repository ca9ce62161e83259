// The dense parts of a Llama decoder layer, around its attention, in two calls (fp32, CPU):
//
//   attention inputs: xn = RMSNorm(h); [q k v] = xn [Wq; Wk; Wv]^T; rotary on q and k
//   MLP block:        h += attn Wo^T; xn = RMSNorm(h); h += (SiLU(xn Wg^T) * xn Wu^T) Wd^T
//
// In between, the engine writes k and v to the paged cache and attends, through the backend interface
// as for every model. Done op by op in torch, these parts are some 50 aten calls a layer (a large share
// of a small model's decode step, docs/cpu_kernels.md); here they are two calls, and q/k/v and gate/up
// are each one product over one packed weight ([Wq; Wk; Wv] and [Wg; Wu] stacked).
// The arithmetic is transformers' up to rounding (sums in another order, fused multiply-adds, the SiLU's
// exp from a polynomial within 2 ulp). Included by attention.cpp after linear.h.

#pragma once

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
