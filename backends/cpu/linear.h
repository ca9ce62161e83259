// The fp32 linear layer y = x W^T (+ bias) of a CPU step, on a weight packed once into column panels.
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
// per panel. Each thread takes an equal contiguous range of panels (to one panel, so SmolLM2's 36-panel
// o_proj splits 18 : 18 rather than 5 : 4 groups) and walks it kGroup panels at a time, so each streams
// its own part of the weight; the rows of x (a few KB to a few hundred KB) stay in the core's L2
// and are reread for every panel.
// Beyond kRowChunk rows, x no longer fits there, so longer inputs are multiplied kRowChunk rows at a time.
// Inputs that fit one pass take the k-blocked loop of linear_blocked instead (see the note there).
//
// Every output is one fp32 sum over k in order (fused multiply-adds), like a dot product, so results
// differ from MKL's or oneDNN's in rounding only. Included by attention.cpp after simd.h.

#pragma once

constexpr int kNr = 2 * kLanes;                 // output columns of a panel: two vectors
constexpr int kMr = kRegisters >= 32 ? 12 : 6;  // rows of the register tile
constexpr int kRowChunk = 60;                   // rows multiplied per pass over the weight: whole tiles

// Output columns per group of panels a thread takes at once, and the accumulator registers a tile may use.
constexpr int kGroup = 4;
static_assert(kRowChunk % kMr == 0, "a chunk is whole register tiles, with no tail tile");
constexpr int kAccumulators = kRegisters >= 32 ? 24 : 12;
// Panels a tile of `rows` rows spans: the rows left over after the full kMr-row tiles (a decode step of
// 1-5 sequences is only such rows) would leave the FMA units waiting on too few accumulators with one
// panel, so they take 2 or 4 panels side by side (also 2-4 weight streams in flight instead of one).
constexpr int panels_for(int rows) {
  return rows * 2 * 4 <= kAccumulators ? 4 : (rows * 2 * 2 <= kAccumulators ? 2 : 1);
}
// How far ahead (floats) a tile's first pass over its panels prefetches them: 4 KB, the next page.
constexpr int kPrefetch = 1024;

// out[0, cols) (+)= the sums of one row of a panel (two vectors) + its bias; only `cols` floats are touched.
inline void store_sum(float* out, vfloat sum0, vfloat sum1, const float* bias_row, int cols, bool accumulate) {
  float row[kNr] = {};
  if (accumulate) std::memcpy(row, out, cols * sizeof(float));
  store(row, load(row) + (sum0 + load(bias_row)));
  store(row + kLanes, load(row + kLanes) + (sum1 + load(bias_row + kLanes)));
  std::memcpy(out, row, cols * sizeof(float));
}

template <int MR, int NP>
inline void linear_tile(const float* x, int64_t ldx, const float* w, int64_t panel_stride, int K, const float* bias,
                        float* y, int64_t ldy, int ncols, bool accumulate, bool prefetch) {
  vfloat acc[MR][NP][2];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p][0] = acc[r][p][1] = vfloat{};
  prefetch = prefetch && MR >= 4;  // the 1-3 row tiles stream faster without
  for (int k = 0; k < K; ++k) {
    for (int p = 0; p < NP; ++p) {
      const float* wk = w + p * panel_stride + static_cast<int64_t>(k) * kNr;
      if (prefetch) __builtin_prefetch(wk + kPrefetch);
      const vfloat w0 = load(wk), w1 = load(wk + kLanes);
      for (int r = 0; r < MR; ++r) {
        const vfloat b = splat(x[r * ldx + k]);
        acc[r][p][0] += b * w0;
        acc[r][p][1] += b * w1;
      }
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
struct GroupArgs {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t panel_stride;
  int K;
  const float* bias;
  float* y;
  int64_t ldy;
  int ncols;
  int panels;
  bool accumulate;
};

template <int MR, int NP>
inline void group_tiles(const GroupArgs& g, int m0, bool prefetch) {
  const float* x = g.x + m0 * g.ldx;
  float* y = g.y + m0 * g.ldy;
  // a group at the end of a thread's range may have fewer panels: as many NP-panel tiles as fit, then 2, then 1
  int p = 0;
  auto tile = [&](auto panels) {  // a std::integral_constant: the tile's panels side by side
    constexpr int kPanels = decltype(panels)::value;
    linear_tile<MR, kPanels>(x, g.ldx, g.w + p * g.panel_stride, g.panel_stride, g.K,
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

template <int... R>
inline void rest_tiles(int rows, std::integer_sequence<int, R...>, const GroupArgs& g, int m0) {
  ((rows == R + 1 ? group_tiles<R + 1, panels_for(R + 1)>(g, m0, m0 == 0) : void()), ...);
}

// y[M, N] (+)= x[M, K] W^T + bias for up to kRowChunk rows, x's rows ldx apart; wp is the packed weight.
inline void linear_chunk(const float* x, int M, int64_t ldx, int K, const float* wp, const float* bias, int N,
                         float* y, bool accumulate, int threads) {
  const int panels = (N + kNr - 1) / kNr;
  const int64_t panel_stride = static_cast<int64_t>(K) * kNr;
  threads = std::max(1, std::min(threads, panels));
#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    const int first = static_cast<int>(static_cast<int64_t>(panels) * t / threads);
    const int last = static_cast<int>(static_cast<int64_t>(panels) * (t + 1) / threads);
    for (int p0 = first; p0 < last; p0 += kGroup) {
      const int n0 = p0 * kNr, np = std::min(kGroup, last - p0);
      const GroupArgs g{x, ldx, wp + p0 * panel_stride, panel_stride, K, bias == nullptr ? nullptr : bias + n0,
                        y + n0, N, std::min(np * kNr, N - n0), np, accumulate};
      int m0 = 0;
      for (; m0 + kMr <= M; m0 += kMr) group_tiles<kMr, 1>(g, m0, m0 == 0);
      if (m0 < M) rest_tiles(M - m0, std::make_integer_sequence<int, kMr - 1>{}, g, m0);
    }
  }
}

constexpr int kKBlock = 64;  // k steps of a block: 64 rows of a panel, 4 KB on AVX2

// One k block of a row tile over one panel: the tile's sums so far are in c (MR rows of kNr floats), unless
// this is the first block. The tile prefetches rows of the panel's next block: with kShared, one row in
// `share` from row `mine` on, so that `share` tiles split the requests; otherwise every row if `share` is 1.
template <int MR, bool kShared>
inline void block_tile(const float* x, int64_t ldx, const float* w, int kn, float* c, bool first, int share,
                       int mine) {
  vfloat acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = first ? vfloat{} : load(c + r * kNr);
    acc[r][1] = first ? vfloat{} : load(c + r * kNr + kLanes);
  }
  const float* next = w + kKBlock * kNr;
  if (kShared) {
    for (int k0 = 0; k0 < kn; k0 += share) {
      __builtin_prefetch(next + (k0 + mine) * kNr);
      for (int k = k0; k < std::min(kn, k0 + share); ++k) {
        const vfloat w0 = load(w + k * kNr), w1 = load(w + k * kNr + kLanes);
        for (int r = 0; r < MR; ++r) {
          const vfloat b = splat(x[r * ldx + k]);
          acc[r][0] += b * w0;
          acc[r][1] += b * w1;
        }
      }
    }
  } else {
    for (int k = 0; k < kn; ++k) {
      if (share == 1) __builtin_prefetch(next + k * kNr);
      const vfloat w0 = load(w + k * kNr), w1 = load(w + k * kNr + kLanes);
      for (int r = 0; r < MR; ++r) {
        const vfloat b = splat(x[r * ldx + k]);
        acc[r][0] += b * w0;
        acc[r][1] += b * w1;
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    store(c + r * kNr, acc[r][0]);
    store(c + r * kNr + kLanes, acc[r][1]);
  }
}

template <int... R>
inline void block_tile_rows(int rows, std::integer_sequence<int, R...>, const float* x, int64_t ldx, const float* w,
                            int kn, float* c, bool first, int share, int mine) {
  if (share > 1)
    ((rows == R + 1 ? block_tile<R + 1, true>(x, ldx, w, kn, c, first, share, mine) : void()), ...);
  else
    ((rows == R + 1 ? block_tile<R + 1, false>(x, ldx, w, kn, c, first, share, mine) : void()), ...);
}

// y[M, N] (+)= x[M, K] W^T + bias for kMr..kRowChunk rows in one pass over the weight, k block by k block.
//
// Why a second loop: when all rows fit one pass, each kKBlock-deep block of a panel is taken by every row
// tile while it is in L1, so the weight stream spreads evenly over the multiply-adds; in linear_chunk's loop
// the first tile streams the panels from memory and the rest reread them from L2, so the memory waits come
// in one burst. With 4 or more tiles they share the next block's prefetches (one tile's would overflow the
// core's miss buffers); tiles are of equal size so none has too few accumulators. Longer inputs, and the
// 4-lane build that memory never holds up, keep linear_chunk. Measurements: docs/cpu_kernels.md.
constexpr bool kBlockedPass = kLanes >= 8;
inline void linear_blocked(const float* x, int M, int64_t ldx, int K, const float* wp, const float* bias, int N,
                           float* y, bool accumulate, int threads) {
  const int panels = (N + kNr - 1) / kNr;
  const int64_t panel_stride = static_cast<int64_t>(K) * kNr;
  const int tiles = (M + kMr - 1) / kMr;
  threads = std::max(1, std::min(threads, panels));
#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    alignas(64) float c[kRowChunk * kNr];  // the sums of every row over the current panel
    const int first = static_cast<int>(static_cast<int64_t>(panels) * t / threads);
    const int last = static_cast<int>(static_cast<int64_t>(panels) * (t + 1) / threads);
    for (int p = first; p < last; ++p) {
      const float* w = wp + p * panel_stride;
      for (int k0 = 0; k0 < K; k0 += kKBlock) {
        const int kn = std::min(kKBlock, K - k0);
        for (int i = 0; i < tiles; ++i) {
          const int r0 = M * i / tiles, r1 = M * (i + 1) / tiles;
          // 4+ tiles share the next block's prefetches; with fewer, the first makes them all
          const int share = tiles >= 4 ? tiles : (i == 0 ? 1 : 0);
          block_tile_rows(r1 - r0, std::make_integer_sequence<int, kMr>{}, x + r0 * ldx + k0, ldx,
                          w + static_cast<int64_t>(k0) * kNr, kn, c + r0 * kNr, k0 == 0, share, i);
        }
      }
      const int n0 = p * kNr, cols = std::min(kNr, N - n0);
      float bias_row[kNr] = {};
      if (bias != nullptr) std::memcpy(bias_row, bias + n0, cols * sizeof(float));
      for (int r = 0; r < M; ++r)
        store_sum(y + r * N + n0, load(c + r * kNr), load(c + r * kNr + kLanes), bias_row, cols, accumulate);
    }
  }
}

// y[rows, N] (+)= x[rows, K] W^T + bias, any number of rows: kRowChunk rows per pass over the weight.
inline void linear_rows_all(const float* x, int64_t ldx, int64_t rows, int K, const float* wp, const float* bias,
                            int N, float* y, bool accumulate, int threads) {
  if (kBlockedPass && rows >= kMr && rows <= kRowChunk)
    return linear_blocked(x, static_cast<int>(rows), ldx, K, wp, bias, N, y, accumulate, threads);
  for (int64_t m = 0; m < rows; m += kRowChunk)
    linear_chunk(x + m * ldx, static_cast<int>(std::min<int64_t>(kRowChunk, rows - m)), ldx, K, wp, bias, N,
                 y + m * N, accumulate, threads);
}
