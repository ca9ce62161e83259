// Prefill attention: many query rows share every K/V chunk (for attention.cpp; Params, Unit and the row offsets
// from paged.h, the vector layer from simd.h).
//
// A unit (sequence, tile of query tokens, KV heads) walks its keys in chunks of kChunk rows through the
// block table, as the general path does. Per chunk and KV head the chunk's K is transposed once
// (kt[x][j], keys in the lanes), then the unit's rows go through it in register blocks of R rows: the
// R x kChunk scores stay in registers, get masked (causal edge, window, chunk tail) by lane compares,
// the online softmax runs on them as vectors (one horizontal max per row and chunk; the row sums stay
// vectors until the end), and P.V adds into the rows' accumulators with every V row load shared by
// the R rows. Blocks that see no key of a chunk (causal) are skipped.

#pragma once

#include "paged.h"

namespace {

// kRowBlock, kKeyVecs (register tiles) and kChunk come from simd.h, per instruction set.
constexpr int kPrefillMinRows = 8;  // fewer rows than this do not pay for transposing each K chunk

// kt[x][j] = k_j[x] for the chunk's n key rows (lanes j >= n are zero), kLanes x kLanes blocks at a time.
template <typename T, int DT>
inline void transpose_chunk(const T* const* k, int n, float* kt) {
  for (int j0 = 0; j0 < kChunk; j0 += kLanes)
    for (int x0 = 0; x0 < DT; x0 += kLanes) {
      vfloat r[kLanes];
      for (int l = 0; l < kLanes; ++l) r[l] = j0 + l < n ? load_row<T>(k[j0 + l] + x0) : vfloat{};
      transpose_lanes(r);
      for (int x = 0; x < kLanes; ++x) store(kt + (x0 + x) * kChunk + j0, r[x]);
    }
}

struct PrefillScratch {
  std::vector<float> q, acc, row_max, row_sum, kt, v;  // row_sum: kLanes partial sums per row
};

// What one block of rows needs to know about the current chunk.
struct ChunkRows {
  const float* kt;         // [DT][kChunk] transposed keys (lanes past n are zero)
  const float* const* v;   // n value rows
  const int* j_begin;      // per row: visible keys of the chunk are [j_begin, j_end)
  const int* j_end;
  bool masked;             // some row sees less than the whole chunk
  float softcap;           // 0 = off; else scores are capped, then scaled by log2(e)
};

// R rows against one chunk: q [R][DT] (pre-scaled), acc [R][DT], row_max [R], row_sum [R][kLanes].
template <int DT, int R>
void prefill_block(const float* q, const ChunkRows& c, float* acc, float* row_max, float* row_sum) {
  int jlo = kChunk, jhi = 0;
  for (int r = 0; r < R; ++r)
    if (c.j_begin[r] < c.j_end[r]) {
      jlo = std::min(jlo, c.j_begin[r]);
      jhi = std::max(jhi, c.j_end[r]);
    }
  if (jlo >= jhi) return;  // no row of the block sees this chunk

  vfloat s[R][kKeyVecs] = {};
  for (int x = 0; x < DT; ++x) {
    vfloat k[kKeyVecs];
    for (int i = 0; i < kKeyVecs; ++i) k[i] = load(c.kt + x * kChunk + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const float qx = q[r * DT + x];
      for (int i = 0; i < kKeyVecs; ++i) s[r][i] += qx * k[i];
    }
  }
  if (c.softcap > 0.0f) {  // rare (Gemma 2): lane by lane
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kKeyVecs; ++i)
        for (int l = 0; l < kLanes; ++l) s[r][i][l] = c.softcap * std::tanh(s[r][i][l] / c.softcap) * kLog2e;
  }
  if (c.masked) {
    const vint lane = lane_index();
    const vfloat hidden = splat(-INFINITY);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kKeyVecs; ++i) {
        const vint j = lane + i * kLanes;
        s[r][i] = ((j >= c.j_begin[r]) & (j < c.j_end[r])) ? s[r][i] : hidden;
      }
  }

  alignas(64) float prob[R][kChunk];
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    vfloat m = s[r][0];
    for (int i = 1; i < kKeyVecs; ++i) m = vmax(m, s[r][i]);
    const float old_max = row_max[r];
    const float new_max = std::max(old_max, max_lanes(m));
    if (new_max == -INFINITY) {  // nothing seen yet, nor in this chunk: the row stays empty
      alpha[r] = 1.0f;
      for (int i = 0; i < kKeyVecs; ++i) store(prob[r] + i * kLanes, vfloat{});
      continue;
    }
    alpha[r] = old_max == -INFINITY ? 0.0f : exp2_neg(old_max - new_max);
    vfloat sum = {};
    for (int i = 0; i < kKeyVecs; ++i) {
      const vfloat e = exp2_neg_vec(s[r][i] - new_max);
      store(prob[r] + i * kLanes, e);
      sum += e;
    }
    row_max[r] = new_max;
    store(row_sum + r * kLanes, load(row_sum + r * kLanes) * alpha[r] + sum);
  }

  // P.V in slices of up to kPvSlice vectors of the head dim, so R x slice accumulators stay in registers.
  constexpr int kSlice = DT / kLanes < kPvSlice ? DT / kLanes : kPvSlice;
  for (int x0 = 0; x0 < DT; x0 += kSlice * kLanes) {
    vfloat a[R][kSlice];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kSlice; ++i) a[r][i] = load(acc + r * DT + x0 + i * kLanes) * alpha[r];
    for (int j = jlo; j < jhi; ++j) {
      vfloat vr[kSlice];
      for (int i = 0; i < kSlice; ++i) vr[i] = load(c.v[j] + x0 + i * kLanes);
      for (int r = 0; r < R; ++r) {
        const float pj = prob[r][j];
        for (int i = 0; i < kSlice; ++i) a[r][i] += pj * vr[i];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kSlice; ++i) store(acc + r * DT + x0 + i * kLanes, a[r][i]);
  }
}

// The last M % kRowBlock rows of a head (kRowBlock is at most 6).
template <int DT>
void prefill_tail(int rows, const float* q, const ChunkRows& c, float* acc, float* row_max, float* row_sum) {
  switch (rows) {
    case 1: prefill_block<DT, 1>(q, c, acc, row_max, row_sum); break;
    case 2: prefill_block<DT, 2>(q, c, acc, row_max, row_sum); break;
    case 3: prefill_block<DT, 3>(q, c, acc, row_max, row_sum); break;
    case 4: prefill_block<DT, 4>(q, c, acc, row_max, row_sum); break;
    case 5: prefill_block<DT, 5>(q, c, acc, row_max, row_sum); break;
    default: break;
  }
}

// Head dims that are whole vectors; rows m of a KV head are token m / G, query head m % G of the group.
template <typename T, int DT>
void run_prefill_unit(const Params& p, const Unit& u, PrefillScratch& w) {
  static_assert(DT > 0 && DT % kLanes == 0, "the prefill path needs a head dim of whole vectors");
  const int G = p.num_heads / p.num_kv_heads;
  const int bs = p.block_size;
  const int M = (u.t1 - u.t0) * G;
  const int nh = u.h1 - u.h0;
  const int ctx = p.context_lens[u.seq];
  const int qs = p.query_start_loc[u.seq];
  const int32_t* table = p.block_tables + static_cast<int64_t>(u.seq) * p.bt_stride;

  w.q.resize(static_cast<size_t>(nh) * M * DT);
  w.acc.assign(static_cast<size_t>(nh) * M * DT, 0.0f);
  w.row_max.assign(static_cast<size_t>(nh) * M, -INFINITY);
  w.row_sum.assign(static_cast<size_t>(nh) * M * kLanes, 0.0f);
  w.kt.resize(static_cast<size_t>(DT) * kChunk);
  if (sizeof(T) != sizeof(float)) w.v.resize(static_cast<size_t>(kChunk) * DT);

  scaled_queries<T>(p, u, DT, w.q.data());

  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * DT;
  const int64_t block_stride = row_stride * bs;
  const int64_t span_bytes = static_cast<int64_t>(nh) * DT * sizeof(T);
  const T* kc = static_cast<const T*>(p.k_cache) + static_cast<int64_t>(u.h0) * DT;
  const T* vc = static_cast<const T*>(p.v_cache) + static_cast<int64_t>(u.h0) * DT;
  const int k_hi = ctx + u.t1;
  const int k_lo = p.window > 0 ? std::max(0, ctx + u.t0 - p.window + 1) : 0;

  std::vector<int> j_begin(M), j_end(M);
  int64_t off[2][kChunk];
  const T* krow[kChunk];
  const float* vrow[kChunk];
  int cur = 0;
  row_offsets(table, k_lo, std::min(kChunk, k_hi - k_lo), bs, block_stride, row_stride, off[cur]);
  for (int c0 = k_lo; c0 < k_hi; c0 += kChunk, cur ^= 1) {
    const int n = std::min(kChunk, k_hi - c0);
    if (c0 + kChunk < k_hi) {
      const int n_next = std::min(kChunk, k_hi - c0 - kChunk);
      row_offsets(table, c0 + kChunk, n_next, bs, block_stride, row_stride, off[cur ^ 1]);
      prefetch_rows(kc, off[cur ^ 1], n_next, span_bytes);
      prefetch_rows(vc, off[cur ^ 1], n_next, span_bytes);
    }
    bool masked = n < kChunk;
    for (int m = 0; m < M; ++m) {
      const int pos = ctx + u.t0 + m / G;
      j_end[m] = std::min(n, pos - c0 + 1);
      j_begin[m] = p.window > 0 ? std::max(0, pos - p.window + 1 - c0) : 0;
      masked = masked || j_end[m] < kChunk || j_begin[m] > 0;
    }
    for (int hh = 0; hh < nh; ++hh) {
      const int64_t head = static_cast<int64_t>(hh) * DT;
      float* kt = w.kt.data();
      for (int j = 0; j < n; ++j) krow[j] = kc + off[cur][j] + head;
      transpose_chunk<T, DT>(krow, n, kt);
      for (int j = 0; j < n; ++j) {
        const T* vr = vc + off[cur][j] + head;
        if constexpr (sizeof(T) == sizeof(float)) {
          vrow[j] = reinterpret_cast<const float*>(vr);
        } else {
          float* vd = w.v.data() + static_cast<int64_t>(j) * DT;
          for (int x = 0; x < DT; x += kLanes) store(vd + x, load_row<T>(vr + x));
          vrow[j] = vd;
        }
      }
      const int64_t base = static_cast<int64_t>(hh) * M;
      const float* qh = w.q.data() + base * DT;
      float* acc = w.acc.data() + base * DT;
      float* rmax = w.row_max.data() + base;
      float* rsum = w.row_sum.data() + base * kLanes;
      int m = 0;
      for (; m + kRowBlock <= M; m += kRowBlock) {
        const ChunkRows c{kt, vrow, j_begin.data() + m, j_end.data() + m, masked, p.softcap};
        prefill_block<DT, kRowBlock>(qh + m * DT, c, acc + m * DT, rmax + m, rsum + m * kLanes);
      }
      if (m < M) {
        const ChunkRows c{kt, vrow, j_begin.data() + m, j_end.data() + m, masked, p.softcap};
        prefill_tail<DT>(M - m, qh + m * DT, c, acc + m * DT, rmax + m, rsum + m * kLanes);
      }
    }
  }

  T* obase = static_cast<T*>(p.out);
  for (int r = 0; r < nh * M; ++r) {
    const int m = r % M;
    const int t = u.t0 + m / G, h = (u.h0 + r / M) * G + m % G;
    T* dst = obase + (static_cast<int64_t>(qs + t) * p.num_heads + h) * DT;
    const float* am = w.acc.data() + static_cast<int64_t>(r) * DT;
    store_normalized(dst, am, add_lanes(load(w.row_sum.data() + static_cast<int64_t>(r) * kLanes)), DT);
  }
}

}  // namespace
