// The decode kernel: work units with one query token (every decode step, and the
// last token of a prefill tile), for attention.cpp (and decode_int8.h, which shares its structures).
//
// Why it is separate from run_unit: with one query token a unit has only the G query heads of each
// KV head, so what limits it is how much memory is in flight while it computes, not reuse across
// query rows. So K/V rows are prefetched into L2 a few steps ahead, spread evenly over both phases;
// each K and V row is loaded once for all the group's query heads (in passes that keep their queries
// and accumulators in registers); the scores, max and sums stay vector ops. The choices and what the
// alternatives measured: docs/cpu_kernels.md.

#pragma once

#include "paged.h"

namespace {

constexpr int kDecodeKeys = kLanes;  // keys per step: one shuffle tree (simd.h)
// Prefetch distance in keys, a multiple of kDecodeKeys (nearer or farther measured no better).
constexpr int kDecodeAhead = 32;
// __builtin_prefetch locality 1 = prefetcht2: into L2, not L1, where the whole step's data would
// evict the rows in use.
constexpr int kPrefetchLocality = 1;

// Stand-in for the keys past the end of a partial step: zeros, never the cache's unused slots.
alignas(64) const float kZeroRow[256] = {};

// Online-softmax state of one query head: running max (log2 units), per-lane running sum.
struct DecodeHead {
  float max;
  vfloat sum;
};

// Per-thread scratch of a decode unit, for every cache format.
struct DecodeScratch {
  std::vector<float> q, acc;
  std::vector<DecodeHead> head;
  // offsets of the rows of the steps in flight (ring): in elements, or in bytes for int8 rows (decode_int8.h)
  std::vector<int64_t> off;
};

// Walks the K and V rows of a later step in address order (all the unit's heads of a
// row, then the next row), a few cache lines per call, so the prefetches spread evenly
// over the arithmetic in between.
struct PrefetchCursor {
  const char* k;
  const char* v;
  const int64_t* off;  // element offsets of the rows
  int elem, rows, lines_per_row, per_call;
  int row = 0, line = 0;

  __attribute__((always_inline)) inline void issue() {
    for (int c = 0; c < per_call && row < rows; ++c) {
      const int64_t at = off[row] * elem + static_cast<int64_t>(line) * 64;
      __builtin_prefetch(k + at, 0, kPrefetchLocality);
      __builtin_prefetch(v + at, 0, kPrefetchLocality);
      if (++line == lines_per_row) {
        line = 0;
        ++row;
      }
    }
  }
};

// The scores of inputs [base, base + 2^Depth) for GB heads, built depth first as the leaves come, so only
// log2(kLanes) partial sums a head are live. A leaf covers 2^LeafDepth inputs: leaf(i, out) computes inputs
// [i, i + 2^LeafDepth) already joined at the tree's first LeafDepth levels (the int8 kernel's leaves are key
// pairs, so each query vector it loads from L1 serves two K rows; the float kernels' are single keys).
template <int GB, int Depth = kLaneBits, int LeafDepth = 0, typename Leaf>
inline void tree_of_leaves(Leaf& leaf, int base, vfloat* out) {
  if constexpr (Depth == LeafDepth) {
    leaf(base, out);
  } else {
    vfloat a[GB], b[GB];
    tree_of_leaves<GB, Depth - 1, LeafDepth>(leaf, base, a);
    tree_of_leaves<GB, Depth - 1, LeafDepth>(leaf, base + (1 << (Depth - 1)), b);
    for (int g = 0; g < GB; ++g) out[g] = tree_level<(kLanes >> Depth)>(a[g], b[g]);
  }
}

// One step of up to kDecodeKeys keys (n valid; rows past n point at kZeroRow) for GB query heads
// of one KV head: q [GB][DT] pre-scaled, acc [GB][DT], state hs[GB]; pf (or nullptr)
// advanced once per key in each of the two phases.
template <typename T, int DT, int GB>
inline void decode_step(const float* q, const T* const* kr, const T* const* vr, int n, PrefetchCursor* pf,
                        float softcap, float* acc, DecodeHead* hs) {
  constexpr int NV = DT / kLanes;
  vfloat qv[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) qv[g][i] = load(q + g * DT + i * kLanes);

  auto leaf = [&](int input, vfloat* out) {
    const int j = tree_lane(input);
    if (pf != nullptr) pf->issue();
    vfloat kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = load_row<T>(kr[j] + i * kLanes);
    for (int g = 0; g < GB; ++g) {
      vfloat a = qv[g][0] * kv[0];
      for (int i = 1; i < NV; ++i) a += qv[g][i] * kv[i];
      out[g] = a;
    }
  };
  vfloat s[GB];
  tree_of_leaves<GB>(leaf, 0, s);

  const vint valid = lane_index() < n;
  const vfloat ninf = vfloat{} - INFINITY;
  alignas(64) float prob[GB][kDecodeKeys];
  float alpha[GB];
  for (int g = 0; g < GB; ++g) {
    vfloat sg = s[g];
    if (softcap > 0.0f) {
      alignas(64) float t[kDecodeKeys];
      store(t, sg);
      for (int j = 0; j < kDecodeKeys; ++j) t[j] = softcap * std::tanh(t[j] / softcap) * kLog2e;
      sg = load(t);
    }
    sg = valid ? sg : ninf;
    const float old_max = hs[g].max;
    const float new_max = std::max(old_max, max_lanes(sg));
    alpha[g] = old_max == -INFINITY ? 0.0f : exp2_neg(old_max - new_max);
    vfloat pg = exp2_neg_vec(sg - new_max);
    pg = valid ? pg : vfloat{};
    hs[g].max = new_max;
    hs[g].sum = hs[g].sum * alpha[g] + pg;
    store(prob[g], pg);
  }

  vfloat a[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = load(acc + g * DT + i * kLanes) * alpha[g];
  for (int j = 0; j < kDecodeKeys; ++j) {
    if (pf != nullptr) pf->issue();
    vfloat vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load_row<T>(vr[j] + i * kLanes);
    for (int g = 0; g < GB; ++g) {
      const float pj = prob[g][j];
      for (int i = 0; i < NV; ++i) a[g][i] += pj * vv[i];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) store(acc + g * DT + i * kLanes, a[g][i]);
}

// Query heads per pass (decode_max_pass, simd.h), so that their queries and accumulators stay in registers.

template <typename T, int DT>
inline void decode_pass(int gb, const float* q, const T* const* kr, const T* const* vr, int n, PrefetchCursor* pf,
                        float softcap, float* acc, DecodeHead* hs) {
  constexpr int kMax = decode_max_pass(DT);  // only the pass sizes this head dim uses are compiled
  if (kMax >= 4 && gb == 4)
    decode_step<T, DT, (kMax >= 4 ? 4 : 1)>(q, kr, vr, n, pf, softcap, acc, hs);
  else if (kMax >= 3 && gb == 3)
    decode_step<T, DT, (kMax >= 3 ? 3 : 1)>(q, kr, vr, n, pf, softcap, acc, hs);
  else if (kMax >= 2 && gb == 2)
    decode_step<T, DT, (kMax >= 2 ? 2 : 1)>(q, kr, vr, n, pf, softcap, acc, hs);
  else
    decode_step<T, DT, 1>(q, kr, vr, n, pf, softcap, acc, hs);
}

// Where a decode unit's keys are: [k_lo, k_hi), K/V of its first head, lines per row of its heads.
template <typename T, int DT>
struct DecodeRows {
  int k_lo, k_hi, lines_per_row;
  const int32_t* table;
  const T* k;
  const T* v;

  DecodeRows(const Params& p, const Unit& u) {
    const int pos = p.context_lens[u.seq] + u.t0;
    k_lo = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;
    k_hi = pos + 1;
    lines_per_row = static_cast<int>((static_cast<int64_t>(u.h1 - u.h0) * DT * sizeof(T) + 63) / 64);
    table = p.block_tables + static_cast<int64_t>(u.seq) * p.bt_stride;
    k = static_cast<const T*>(p.k_cache) + static_cast<int64_t>(u.h0) * DT;
    v = static_cast<const T*>(p.v_cache) + static_cast<int64_t>(u.h0) * DT;
  }
};

// One query token (position context_len + t0) against keys [k_lo, pos] of KV heads [h0, h1).
// next (or nullptr): the decode unit this thread runs next, whose first steps are prefetched
// during this unit's last ones (else every unit would start with cold misses).
template <typename T, int DT>
void run_decode_unit(const Params& p, const Unit& u, const Unit* next, DecodeScratch& w) {
  static_assert(DT % kLanes == 0 && DT <= 256, "decode kernel: head dims that are whole vectors");
  constexpr int kMaxPass = decode_max_pass(DT);
  const int G = p.num_heads / p.num_kv_heads;
  const int nh = u.h1 - u.h0;
  const int bs = p.block_size;
  const int qs = p.query_start_loc[u.seq];
  const DecodeRows<T, DT> here(p, u);
  const int k_lo = here.k_lo, k_hi = here.k_hi;
  const int32_t* table = here.table;

  const int rows = nh * G;  // query heads of the unit, KV head major
  w.q.resize(static_cast<size_t>(rows) * DT);
  w.acc.assign(static_cast<size_t>(rows) * DT, 0.0f);
  w.head.assign(rows, DecodeHead{-INFINITY, vfloat{}});
  scaled_queries<T>(p, u, DT, w.q.data());  // one token: row r is query head h0 * G + r

  // Passes of at most kMaxPass query heads, as even as possible (G = 8: 4 + 4, G = 7: 4 + 3).
  const int passes = (G + kMaxPass - 1) / kMaxPass;
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * DT;
  const int64_t block_stride = row_stride * bs;
  const T* kc = here.k;
  const T* vc = here.v;
  const T* zero = reinterpret_cast<const T*>(kZeroRow);
  constexpr int kRing = kDecodeAhead / kDecodeKeys + 1;
  w.off.resize(static_cast<size_t>(kRing) * kDecodeKeys);
  auto offsets = [&](int c0) -> int64_t* { return w.off.data() + ((c0 - k_lo) / kDecodeKeys % kRing) * kDecodeKeys; };
  for (int c0 = k_lo; c0 < std::min(k_hi, k_lo + kDecodeAhead); c0 += kDecodeKeys)
    row_offsets(table, c0, std::min(kDecodeKeys, k_hi - c0), bs, block_stride, row_stride, offsets(c0));

  const T* kr[kDecodeKeys];
  const T* vr[kDecodeKeys];
  const int steps = (k_hi - k_lo + kDecodeKeys - 1) / kDecodeKeys;
  const DecodeRows<T, DT> there = next != nullptr ? DecodeRows<T, DT>(p, *next) : here;
  int64_t next_off[kDecodeKeys];
  for (int c0 = k_lo, step = 0; c0 < k_hi; c0 += kDecodeKeys, ++step) {
    const int n = std::min(kDecodeKeys, k_hi - c0);
    const int64_t* off = offsets(c0);
    // The step whose rows this one prefetches: this unit's, kDecodeAhead keys on, or past its
    // end the next unit's first ones.
    const int a0 = c0 + kDecodeAhead;
    const DecodeRows<T, DT>* ahead = &here;
    const int64_t* ahead_off = offsets(a0);
    int n_ahead = a0 < k_hi ? std::min(kDecodeKeys, k_hi - a0) : 0;
    if (n_ahead > 0) {
      row_offsets(table, a0, n_ahead, bs, block_stride, row_stride, offsets(a0));
    } else if (next != nullptr) {
      const int b0 = there.k_lo + (step + kDecodeAhead / kDecodeKeys - steps) * kDecodeKeys;
      n_ahead = b0 < there.k_hi ? std::min(kDecodeKeys, there.k_hi - b0) : 0;
      row_offsets(there.table, b0, n_ahead, bs, block_stride, row_stride, next_off);
      ahead = &there;
      ahead_off = next_off;
    }
    const int calls = 2 * nh * kDecodeKeys;  // the first pass of each head calls it twice per key
    const int lines_per_row = ahead->lines_per_row;
    PrefetchCursor pf{reinterpret_cast<const char*>(ahead->k), reinterpret_cast<const char*>(ahead->v), ahead_off,
                      static_cast<int>(sizeof(T)), n_ahead, lines_per_row,
                      (n_ahead * lines_per_row + calls - 1) / calls};
    for (int hh = 0; hh < nh; ++hh) {
      const int64_t head = static_cast<int64_t>(hh) * DT;
      for (int j = 0; j < kDecodeKeys; ++j) {
        kr[j] = j < n ? kc + off[j] + head : zero;
        vr[j] = j < n ? vc + off[j] + head : zero;
      }
      for (int pass = 0, g0 = 0; pass < passes; ++pass) {
        const int gb = G / passes + (pass < G % passes ? 1 : 0);
        const int r = hh * G + g0;
        decode_pass<T, DT>(gb, w.q.data() + static_cast<int64_t>(r) * DT, kr, vr, n, pass == 0 ? &pf : nullptr,
                           p.softcap, w.acc.data() + static_cast<int64_t>(r) * DT, w.head.data() + r);
        g0 += gb;
      }
    }
  }

  T* dst = static_cast<T*>(p.out) + (static_cast<int64_t>(qs + u.t0) * p.num_heads + u.h0 * G) * DT;
  for (int r = 0; r < rows; ++r) {
    const float total = add_lanes(w.head[r].sum);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int x = 0; x < DT; ++x) {
      const float o = w.acc[static_cast<size_t>(r) * DT + x] * inv;
      if constexpr (sizeof(T) == sizeof(float))
        dst[static_cast<int64_t>(r) * DT + x] = o;
      else
        dst[static_cast<int64_t>(r) * DT + x] = float_to_bf16(o);
    }
  }
}

}  // namespace
