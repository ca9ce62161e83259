// The fp32 linear layer y = x W^T (+ bias) of a CPU step, on a weight packed once into column panels.
//
// NOTE on why pagedkv multiplies its own matrices. A decode step multiplies a few dozen rows by every
// weight of the model, and none of the model fits in cache (SmolLM2-135M is 540 MB of fp32), so every
// weight comes from memory once per step. oneDNN's and MKL's small-M paths do not keep the FMA units
// busy while they wait for it: on the 2-core Zen 3 (AVX2) the whole model's linears took 61 / 84 / 128 ms
// (oneDNN, packed) at 1 / 8 / 32 rows, this kernel 31 / 44 / 95 ms (benchmarks/JOURNAL.md, 2026-12-01).
//
// Layout: the packed weight is N/kNr panels, each kNr output columns wide and K deep, column-fastest
// ([panel][k][kNr], zero-padded past N). A panel is one contiguous stretch a thread streams through,
// and each k step of it is whole vectors: the micro-kernel keeps a kMr x kNr tile of y in registers
// (AVX2: 6 x 16 = 12 accumulators + 2 weight vectors + 1 broadcast of the 16 ymm registers; AVX-512:
// 12 x 32 = 24 + 2 + 1 of 32 zmm), reads each weight vector once per kMr rows and each x element once
// per panel. Threads take contiguous ranges of panels, so each streams its own part of the weight;
// the rows of x (a few KB to a few hundred KB) stay in the core's L2 and are reread for every panel.
// Beyond kRowChunk rows, x no longer fits there, so longer inputs are multiplied kRowChunk rows at a time.
//
// Every output is one fp32 sum over k in order (fused multiply-adds), like a dot product, so results
// differ from MKL's or oneDNN's in rounding only. Included by attention.cpp after simd.h.

#pragma once

constexpr int kNr = 2 * kLanes;                 // output columns of a panel: two vectors
constexpr int kMr = kRegisters >= 32 ? 12 : 6;  // rows of the register tile
constexpr int kRowChunk = 64;                   // rows multiplied per pass over the weight

template <int MR>
inline void linear_tile(const float* x, int64_t ldx, const float* w, int K, const float* bias, float* y,
                        int64_t ldy, int ncols, bool accumulate) {
  vfloat lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = vfloat{};
  for (int k = 0; k < K; ++k) {
    const vfloat w0 = load(w + static_cast<int64_t>(k) * kNr), w1 = load(w + static_cast<int64_t>(k) * kNr + kLanes);
    for (int r = 0; r < MR; ++r) {
      const vfloat b = splat(x[r * ldx + k]);
      lo[r] += b * w0;
      hi[r] += b * w1;
    }
  }
  float bias_row[kNr] = {};
  if (bias != nullptr) std::memcpy(bias_row, bias, ncols * sizeof(float));
  for (int r = 0; r < MR; ++r) {
    float row[kNr] = {};
    if (accumulate) std::memcpy(row, y + r * ldy, ncols * sizeof(float));
    store(row, load(row) + (lo[r] + load(bias_row)));
    store(row + kLanes, load(row + kLanes) + (hi[r] + load(bias_row + kLanes)));
    std::memcpy(y + r * ldy, row, ncols * sizeof(float));
  }
}

template <int... R>
inline void linear_rows(int rows, std::integer_sequence<int, R...>, const float* x, int64_t ldx, const float* w,
                        int K, const float* bias, float* y, int64_t ldy, int ncols, bool accumulate) {
  ((rows == R + 1 ? linear_tile<R + 1>(x, ldx, w, K, bias, y, ldy, ncols, accumulate) : void()), ...);
}

// y[M, N] (+)= x[M, K] W^T + bias for up to kRowChunk rows, x's rows ldx apart; wp is the packed weight.
inline void linear_chunk(const float* x, int M, int64_t ldx, int K, const float* wp, const float* bias, int N,
                         float* y, bool accumulate, int threads) {
  const int panels = (N + kNr - 1) / kNr;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int p = 0; p < panels; ++p) {
    const float* w = wp + static_cast<int64_t>(p) * K * kNr;
    const int n0 = p * kNr, ncols = std::min(kNr, N - n0);
    for (int m0 = 0; m0 < M; m0 += kMr)
      linear_rows(std::min(kMr, M - m0), std::make_integer_sequence<int, kMr>{}, x + m0 * ldx, ldx, w, K,
                  bias == nullptr ? nullptr : bias + n0, y + static_cast<int64_t>(m0) * N + n0, N, ncols, accumulate);
  }
}
