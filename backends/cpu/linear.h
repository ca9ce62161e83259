// The linear layer y = x W^T (+ bias) of a CPU step, on a weight packed once into column panels: fp32 or bf16
// weights (a "weight format" below), fp32 sums.
//
// Why pagedkv multiplies its own matrices: a decode step multiplies a few dozen rows by every weight of
// the model, none of which fits in cache, so every weight comes from memory once per step; oneDNN's and
// MKL's small-M paths do not keep the FMA units busy while they wait for it (measured against them:
// docs/cpu_kernels.md).
//
// Layout: the packed weight is N/kNr panels, each kNr output columns wide and K deep, column-fastest
// ([panel][k][kNr], zero-padded past N). A panel is one contiguous stretch a thread streams through,
// and each k step of it is whole vectors: the micro-kernel keeps a kMr x kNr tile of y in registers
// (AVX2: 6 x 16 = 12 accumulators + 2 weight vectors + 1 broadcast of the 16 ymm registers; AVX-512:
// 12 x 32 = 24 + 2 + 1 of 32 zmm), reads each weight vector once per kMr rows and each x element once
// per panel. The threads take near-equal contiguous ranges of panels, a few per thread (for_ranges_dynamic), and
// walk each kGroup panels at a time, so each streams its own part of the weight; the rows of x (a few KB to a few hundred KB) stay in the core's L2
// and are reread for every panel.
// Beyond kRowChunk rows, x no longer fits there, so longer inputs are multiplied kRowChunk rows at a time.
// Inputs that fit one pass take the k-blocked loop of linear_blocked instead (see the note there).
//
// Every output is one fp32 sum over k in order (fused multiply-adds), like a dot product, so results
// differ from MKL's or oneDNN's in rounding only (with vdpbf16ps, see Bf16Dot, the inputs are rounded to bf16
// first). For linear.cpp and llama_block.h.

#pragma once

#include "numerics.h"

namespace {

constexpr int kNr = 2 * kLanes;                 // output columns of a panel: two vectors
constexpr int kMr = kRegisters >= 32 ? 12 : 6;  // rows of the register tile
constexpr int kRowChunk = 60;                   // rows multiplied per pass over the weight: whole tiles

// Output columns per group of panels a thread takes at once, and the accumulator registers a tile may use.
constexpr int kGroup = 4;
static_assert(kRowChunk % kMr == 0, "a chunk is whole register tiles, with no tail tile");
// Runs body(first, last) over [0, units) in kChunksPerThread * threads contiguous, near-equal ranges taken
// dynamically. Why not one equal range per thread: on a shared machine a thread can be descheduled for a whole
// time slice; with a fixed split the step waits at the region's end for its range, while here the running
// threads take the ranges it has not started (issue 43: 0.15-0.42x of quiet with one busy neighbour). Quiet,
// the ranges go round-robin and each thread still gets an equal share within one range.
constexpr int kChunksPerThread = 4;
template <class Body>
inline void for_ranges_dynamic(int units, int threads, Body body) {
  threads = std::max(1, std::min(threads, units));
  const int chunks = std::max(1, std::min(units, threads * kChunksPerThread));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int c = 0; c < chunks; ++c)
    body(static_cast<int>(static_cast<int64_t>(units) * c / chunks),
         static_cast<int>(static_cast<int64_t>(units) * (c + 1) / chunks));
}
constexpr int kAccumulators = kRegisters >= 32 ? 24 : 12;
// Panels a tile of `rows` rows spans: the rows left over after the full kMr-row tiles (a decode step of
// 1-5 sequences is only such rows) would leave the FMA units waiting on too few accumulators with one
// panel, so they take 2 or 4 panels side by side (also 2-4 weight streams in flight instead of one).
constexpr int panels_for(int rows) {
  return rows * 2 * 4 <= kAccumulators ? 4 : (rows * 2 * 2 <= kAccumulators ? 2 : 1);
}
// How far ahead (floats) a tile's first pass over its panels prefetches them: 4 KB, the next page.
constexpr int kPrefetch = 1024;


// --- weight formats ---------------------------------------------------------------------------------------
// The loops below walk a panel in "steps" and leave the arithmetic of one step to a format (one loop, one row
// reader per format). A step is kStep values of k; its packed weights are the same kNr x 4 bytes in every
// format (one k of fp32, two of bf16), so block sizes and prefetch distances in bytes are the same too.
//
// bf16 panels are [panel][k / 2][kNr][2]: each column's two consecutive k side by side in 32 bits (the
// operand layout of vdpbf16ps; K padded to even with zeros). Half the bytes of fp32, so a step that is bound by
// reading its weights (a decode step of a few rows) takes nearly half the time.
//
// `madd` adds one step of a panel to the tile's accumulators acc[r][p][0..1]; x points at row 0's inputs of
// the step and ldx is the rows' stride, both in the format's activation elements (X).
struct F32Weights {
  using W = float;
  using X = float;  // the activations as given
  static constexpr int kStep = 1;
  static constexpr int kStepElems = kNr;  // W elements a step of one panel
  static constexpr int kXStep = 1;        // X elements a step of one row
  template <int MR, int NP>
  static inline void madd(vfloat (&acc)[MR][NP][2], int p, const W* w, const X* x, int64_t ldx) {
    const vfloat w0 = load(w), w1 = load(w + kLanes);
    for (int r = 0; r < MR; ++r) {
      const vfloat b = splat(x[r * ldx]);
      acc[r][p][0] += b * w0;
      acc[r][p][1] += b * w1;
    }
  }
};

inline vuint load_pairs(const uint16_t* p) {
  vuint v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat as_floats(vuint v) {
  vfloat f;
  std::memcpy(&f, &v, sizeof(f));
  return f;
}

// bf16 weights widened to fp32 in registers (a shift for the even k, a mask for the odd one), fp32 activations:
// every build. The sums are those of F32Weights on the widened weights, in the same k order.
struct Bf16Widen {
  using W = uint16_t;
  using X = float;  // ldx even: the entry point pads an odd K (linear_bf16)
  static constexpr int kStep = 2;
  static constexpr int kStepElems = 2 * kNr;
  static constexpr int kXStep = 2;
  template <int MR, int NP>
  static inline void madd(vfloat (&acc)[MR][NP][2], int p, const W* w, const X* x, int64_t ldx) {
    const vuint v0 = load_pairs(w), v1 = load_pairs(w + 2 * kLanes);
    const vfloat e0 = as_floats(v0 << 16), e1 = as_floats(v1 << 16);
    for (int r = 0; r < MR; ++r) {
      const vfloat b = splat(x[r * ldx]);
      acc[r][p][0] += b * e0;
      acc[r][p][1] += b * e1;
    }
    const vfloat o0 = as_floats(v0 & 0xffff0000u), o1 = as_floats(v1 & 0xffff0000u);
    for (int r = 0; r < MR; ++r) {
      const vfloat b = splat(x[r * ldx + 1]);
      acc[r][p][0] += b * o0;
      acc[r][p][1] += b * o1;
    }
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512F__) && !defined(PAGEDKV_AVX512_SHAPE)
// AVX-512-BF16: vdpbf16ps adds a column's two products of a step at once, the activations rounded to bf16 pairs
// once per call (the products of two bf16 are exact in fp32; the sums are fp32, denormals flushed).
struct Bf16Dot {
  using W = uint16_t;
  using X = uint32_t;  // (x[k], x[k + 1]) as bf16, k's in the low half
  static constexpr int kStep = 2;
  static constexpr int kStepElems = 2 * kNr;
  static constexpr int kXStep = 1;
  template <int MR, int NP>
  static inline void madd(vfloat (&acc)[MR][NP][2], int p, const W* w, const X* x, int64_t ldx) {
    const __m512bh v0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
    const __m512bh v1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 2 * kLanes));
    for (int r = 0; r < MR; ++r) {
      const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * ldx])));
      acc[r][p][0] = reinterpret_cast<vfloat>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[r][p][0]), v0, b));
      acc[r][p][1] = reinterpret_cast<vfloat>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[r][p][1]), v1, b));
    }
  }
};
using Bf16Weights = Bf16Dot;
constexpr const char* kBf16Path = "avx512-bf16 vdpbf16ps";
#else
using Bf16Weights = Bf16Widen;
constexpr const char* kBf16Path = "widened in registers";
#endif

// out[0, cols) (+)= the sums of one row of a panel (two vectors) + its bias; only `cols` floats are touched.
inline void store_sum(float* out, vfloat sum0, vfloat sum1, const float* bias_row, int cols, bool accumulate) {
  float row[kNr] = {};
  if (accumulate) std::memcpy(row, out, cols * sizeof(float));
  store(row, load(row) + (sum0 + load(bias_row)));
  store(row + kLanes, load(row + kLanes) + (sum1 + load(bias_row + kLanes)));
  std::memcpy(out, row, cols * sizeof(float));
}

template <class F, int MR, int NP>
inline void linear_tile(const typename F::X* x, int64_t ldx, const typename F::W* w, int64_t panel_stride, int steps,
                        const float* bias, float* y, int64_t ldy, int ncols, bool accumulate, bool prefetch) {
  vfloat acc[MR][NP][2];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = vfloat{};
  prefetch = prefetch && MR >= 4;  // the 1-3 row tiles stream faster without
  for (int s = 0; s < steps; ++s) {
    for (int p = 0; p < NP; ++p) {
      const typename F::W* ws = w + p * panel_stride + static_cast<int64_t>(s) * F::kStepElems;
      if (prefetch) __builtin_prefetch(reinterpret_cast<const char*>(ws) + kPrefetch * sizeof(float));
      F::template madd<MR, NP>(acc, p, ws, x + static_cast<int64_t>(s) * F::kXStep, ldx);
    }
  }
  for (int p = 0; p < NP && p * kNr < ncols; ++p) {
    const int cols = std::min(kNr, ncols - p * kNr);
    float bias_row[kNr] = {};
    if (bias != nullptr) std::memcpy(bias_row, bias + p * kNr, cols * sizeof(float));
    for (int r = 0; r < MR; ++r)
      store_sum(y + r * ldy + p * kNr, acc[r][p][0], acc[r][p][1], bias_row, cols, accumulate);
  }
}
// The rows of one group of `panels` panels (ncols columns) from row m0 on: full kMr-row tiles, then the rest.
template <class F>
struct GroupArgs {
  const typename F::X* x;
  int64_t ldx;
  const typename F::W* w;
  int64_t panel_stride;
  int steps;
  const float* bias;
  float* y;
  int64_t ldy;
  int ncols;
  int panels;
  bool accumulate;
};

template <class F, int MR, int NP>
inline void group_tiles(const GroupArgs<F>& g, int m0, bool prefetch) {
  const typename F::X* x = g.x + m0 * g.ldx;
  float* y = g.y + m0 * g.ldy;
  // a group at the end of a thread's range may have fewer panels: as many NP-panel tiles as fit, then 2, then 1
  int p = 0;
  auto tile = [&](auto panels) {  // a std::integral_constant: the tile's panels side by side
    constexpr int kPanels = decltype(panels)::value;
    linear_tile<F, MR, kPanels>(x, g.ldx, g.w + p * g.panel_stride, g.panel_stride, g.steps,
                                g.bias == nullptr ? nullptr : g.bias + p * kNr, y + p * kNr, g.ldy, g.ncols - p * kNr,
                                g.accumulate, prefetch);
    p += kPanels;
  };
  while (p < g.panels) {
    const int left = g.panels - p;
    if (left >= NP)
      tile(std::integral_constant<int, NP>{});
    else if (NP > 2 && left >= 2)
      tile(std::integral_constant<int, 2>{});
    else
      tile(std::integral_constant<int, 1>{});
  }
}

template <class F, int... R>
inline void rest_tiles(int rows, std::integer_sequence<int, R...>, const GroupArgs<F>& g, int m0) {
  ((rows == R + 1 ? group_tiles<F, R + 1, panels_for(R + 1)>(g, m0, m0 == 0) : void()), ...);
}

// y[M, N] (+)= x[M, K] W^T + bias for up to kRowChunk rows, x's rows ldx apart; wp is the packed weight, `steps`
// deep (K / F::kStep, rounded up).
template <class F>
inline void linear_chunk(const typename F::X* x, int M, int64_t ldx, int steps, const typename F::W* wp,
                         const float* bias, int N, float* y, bool accumulate, int threads) {
  const int panels = (N + kNr - 1) / kNr;
  const int64_t panel_stride = static_cast<int64_t>(steps) * F::kStepElems;
  for_ranges_dynamic(panels, threads, [&](int first, int last) {
    for (int p0 = first; p0 < last; p0 += kGroup) {
      const int n0 = p0 * kNr, np = std::min(kGroup, last - p0);
      const GroupArgs<F> g{x, ldx, wp + p0 * panel_stride, panel_stride, steps,
                           bias == nullptr ? nullptr : bias + n0, y + n0, N, std::min(np * kNr, N - n0), np,
                           accumulate};
      int m0 = 0;
      for (; m0 + kMr <= M; m0 += kMr) group_tiles<F, kMr, 1>(g, m0, m0 == 0);
      if (m0 < M) rest_tiles<F>(M - m0, std::make_integer_sequence<int, kMr - 1>{}, g, m0);
    }
  });
}

constexpr int kKBlock = 64;  // steps of a block: 64 steps of a panel, 4 KB on AVX2 (64 k of fp32, 128 of bf16)

// One block of a row tile over one panel: the tile's sums so far are in c (MR rows of kNr floats), unless
// this is the first block. The tile prefetches steps of the panel's next block: with kShared, one step in
// `share` from step `mine` on, so that `share` tiles split the requests; otherwise every step if `share` is 1.
template <class F, int MR, bool kShared>
inline void block_tile(const typename F::X* x, int64_t ldx, const typename F::W* w, int kn, float* c, bool first,
                       int share, int mine) {
  vfloat acc[MR][1][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0][0] = first ? vfloat{} : load(c + r * kNr);
    acc[r][0][1] = first ? vfloat{} : load(c + r * kNr + kLanes);
  }
  const typename F::W* next = w + kKBlock * F::kStepElems;
  if (kShared) {
    for (int k0 = 0; k0 < kn; k0 += share) {
      __builtin_prefetch(next + (k0 + mine) * F::kStepElems);
      for (int k = k0; k < std::min(kn, k0 + share); ++k)
        F::template madd<MR, 1>(acc, 0, w + k * F::kStepElems, x + k * F::kXStep, ldx);
    }
  } else {
    for (int k = 0; k < kn; ++k) {
      if (share == 1) __builtin_prefetch(next + k * F::kStepElems);
      F::template madd<MR, 1>(acc, 0, w + k * F::kStepElems, x + k * F::kXStep, ldx);
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(c + r * kNr, acc[r][0][0]);
    store(c + r * kNr + kLanes, acc[r][0][1]);
  }
}

template <class F, int... R>
inline void block_tile_rows(int rows, std::integer_sequence<int, R...>, const typename F::X* x, int64_t ldx,
                            const typename F::W* w, int kn, float* c, bool first, int share, int mine) {
  if (share > 1)
    ((rows == R + 1 ? block_tile<F, R + 1, true>(x, ldx, w, kn, c, first, share, mine) : void()), ...);
  else
    ((rows == R + 1 ? block_tile<F, R + 1, false>(x, ldx, w, kn, c, first, share, mine) : void()), ...);
}

// y[M, N] (+)= x[M, K] W^T + bias for kMr..kRowChunk rows in one pass over the weight, block by block.
//
// Why a second loop: when all rows fit one pass, each kKBlock-deep block of a panel is taken by every row
// tile while it is in L1, so the weight stream spreads evenly over the multiply-adds; in linear_chunk's loop
// the first tile streams the panels from memory and the rest reread them from L2, so the memory waits come
// in one burst. With 4 or more tiles they share the next block's prefetches (one tile's would overflow the
// core's miss buffers); tiles are of equal size so none has too few accumulators. Longer inputs, and the
// 4-lane build that memory never holds up, keep linear_chunk. Measurements: docs/cpu_kernels.md.
constexpr bool kBlockedPass = kLanes >= 8;
template <class F>
inline void linear_blocked(const typename F::X* x, int M, int64_t ldx, int steps, const typename F::W* wp,
                           const float* bias, int N, float* y, bool accumulate, int threads) {
  const int panels = (N + kNr - 1) / kNr;
  const int64_t panel_stride = static_cast<int64_t>(steps) * F::kStepElems;
  const int tiles = (M + kMr - 1) / kMr;
  for_ranges_dynamic(panels, threads, [&](int first, int last) {
    alignas(64) float c[kRowChunk * kNr];  // the sums of every row over the current panel
    for (int p = first; p < last; ++p) {
      const typename F::W* w = wp + p * panel_stride;
      for (int k0 = 0; k0 < steps; k0 += kKBlock) {
        const int kn = std::min(kKBlock, steps - k0);
        for (int i = 0; i < tiles; ++i) {
          const int r0 = M * i / tiles, r1 = M * (i + 1) / tiles;
          // 4+ tiles share the next block's prefetches; with fewer, the first makes them all
          const int share = tiles >= 4 ? tiles : (i == 0 ? 1 : 0);
          block_tile_rows<F>(r1 - r0, std::make_integer_sequence<int, kMr>{}, x + r0 * ldx + k0 * F::kXStep, ldx,
                             w + static_cast<int64_t>(k0) * F::kStepElems, kn, c + r0 * kNr, k0 == 0, share, i);
        }
      }
      const int n0 = p * kNr, cols = std::min(kNr, N - n0);
      float bias_row[kNr] = {};
      if (bias != nullptr) std::memcpy(bias_row, bias + n0, cols * sizeof(float));
      for (int r = 0; r < M; ++r)
        store_sum(y + r * N + n0, load(c + r * kNr), load(c + r * kNr + kLanes), bias_row, cols, accumulate);
    }
  });
}

// y[rows, N] (+)= x[rows, K] W^T + bias, any number of rows: kRowChunk rows per pass over the weight. x and ldx
// are in the format's activation elements, `steps` = ceil(K / F::kStep).
template <class F = F32Weights>
inline void linear_rows_all(const typename F::X* x, int64_t ldx, int64_t rows, int steps, const typename F::W* wp,
                            const float* bias, int N, float* y, bool accumulate, int threads) {
  if (kBlockedPass && rows >= kMr && rows <= kRowChunk)
    return linear_blocked<F>(x, static_cast<int>(rows), ldx, steps, wp, bias, N, y, accumulate, threads);
  for (int64_t m = 0; m < rows; m += kRowChunk)
    linear_chunk<F>(x + m * ldx, static_cast<int>(std::min<int64_t>(kRowChunk, rows - m)), ldx, steps, wp, bias, N,
                    y + m * N, accumulate, threads);
}

// fp32 activations x [rows, k] (rows ldx apart) as format F reads them: as they are where that works (fp32
// weights; bf16 widened with an even K), else made once in buf: rounded to bf16 pairs for Bf16Dot (an odd K's last
// pair takes a zero), copied with a zero column for Bf16Widen with an odd K (a step reads two columns). Sets *out,
// returns the rows' stride in X elements.
template <class F>
inline int64_t activations(const float* x, int64_t ldx, int64_t rows, int64_t k, std::vector<typename F::X>& buf,
                           const typename F::X** out) {
  using X = typename F::X;
  const int64_t steps = (k + F::kStep - 1) / F::kStep;
  if constexpr (std::is_same_v<X, float>) {
    if (k % F::kStep == 0) {
      *out = x;
      return ldx;
    }
  }
  const int64_t ld = steps * F::kXStep;
  buf.assign(static_cast<size_t>(rows * ld), X{});
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * ldx;
    X* dst = buf.data() + r * ld;
    if constexpr (std::is_same_v<X, float>) {
      std::memcpy(dst, row, static_cast<size_t>(k) * sizeof(float));
    } else {
      for (int64_t s = 0; s < steps; ++s) {
        const uint32_t lo = float_to_bf16(row[2 * s]);
        const uint32_t hi = 2 * s + 1 < k ? float_to_bf16(row[2 * s + 1]) : 0u;
        dst[s] = lo | (hi << 16);
      }
    }
  }
  *out = buf.data();
  return ld;
}

// y[rows, N] (+)= x[rows, k] W^T + bias for fp32 activations (rows ldx apart) on a weight of format F; buf is
// scratch for activations<F>.
template <class F>
inline void linear_from_f32(const float* x, int64_t ldx, int64_t rows, int64_t k, const typename F::W* wp,
                            const float* bias, int N, float* y, bool accumulate, int threads,
                            std::vector<typename F::X>& buf) {
  const typename F::X* xs = nullptr;
  const int64_t ld = activations<F>(x, ldx, rows, k, buf, &xs);
  linear_rows_all<F>(xs, ld, rows, static_cast<int>((k + F::kStep - 1) / F::kStep), wp, bias, N, y, accumulate,
                     threads);
}

}  // namespace
