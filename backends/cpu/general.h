// The general attention path: any unit (tokens x KV heads) and any head dim, keys in chunks of kChunk rows
// with an online softmax in fp32 (docs/cpu_kernels.md, "Work units and the general path"). attention.cpp sends
// it what the decode (decode.h) and prefill (prefill.h) kernels do not take.

#pragma once

#include "paged.h"

namespace {

struct Scratch {
  std::vector<float> q, acc, s, row_max, row_sum, k, v, kt, alpha;
  std::vector<int> range;
};

// Keys are taken in chunks of up to kChunk rows (simd.h) that may span several blocks, so the
// softmax bookkeeping (max, rescale) is paid once per chunk whatever the block size.

// scores[m][j] = q[m] . k[j] for M query rows and n key rows.
template <int DT>
void scores_dot(const float* q, int M, int d_rt, const float* const* k, int n, float* s) {
  const int d = DT ? DT : d_rt;
  for (int j = 0; j < n; ++j) {
    const float* kr = k[j];
    for (int m = 0; m < M; ++m) {
      const float* qm = q + static_cast<int64_t>(m) * d;
      float a = 0.0f;
#pragma omp simd reduction(+ : a)
      for (int x = 0; x < d; ++x) a += qm[x] * kr[x];
      s[m * kChunk + j] = a;
    }
  }
}

// kLanes dot products at once, for head dims that are whole vectors: the partial vectors of
// kLanes keys are summed by a shuffle tree into one vector of kLanes scores (a horizontal sum
// per key is a chain of dependent scalar adds).
template <int DT>
void scores_dot_vec(const float* q, int M, const float* const* k, int n, float* s) {
  constexpr int NV = DT / kLanes;
  vfloat part[kLanes];
  for (int m = 0; m < M; ++m) {
    vfloat qm[NV];
    for (int i = 0; i < NV; ++i) qm[i] = load(q + m * DT + i * kLanes);
    for (int j0 = 0; j0 < n; j0 += kLanes) {
      for (int lane = 0; lane < kLanes; ++lane) {
        vfloat a = {};
        if (j0 + lane < n) {
          const float* kr = k[j0 + lane];
          for (int i = 0; i < NV; ++i) a += qm[i] * load(kr + i * kLanes);
        }
        part[tree_lane(lane)] = a;
      }
      store(s + m * kChunk + j0, sum_lanes_tree(part));
    }
  }
}

// The same through a transposed copy of the chunk, vectorized over keys: worth the
// transpose once many query rows share the chunk (prefill). kScoreRows query rows at a
// time keep their scores in registers, so each transposed K load feeds kScoreRows FMAs.
constexpr int kScoreRows = kRegisters >= 32 ? 4 : 2;

template <int DT>
void scores_transposed(const float* q, int M, int d_rt, const float* const* k, int n, float* s, float* kt) {
  const int d = DT ? DT : d_rt;
  for (int j = 0; j < n; ++j)
    for (int x = 0; x < d; ++x) kt[x * kChunk + j] = k[j][x];
  for (int j = n; j < kChunk; ++j)
    for (int x = 0; x < d; ++x) kt[x * kChunk + j] = 0.0f;
  constexpr int NV = kChunk / kLanes;
  int m = 0;
  for (; m + kScoreRows <= M; m += kScoreRows) {
    vfloat acc[kScoreRows][NV] = {};
    const float* q0 = q + static_cast<int64_t>(m) * d;
    for (int x = 0; x < d; ++x) {
      const float* kx = kt + x * kChunk;
      vfloat kv[NV];
      for (int i = 0; i < NV; ++i) kv[i] = load(kx + i * kLanes);
      for (int r = 0; r < kScoreRows; ++r) {
        const float qx = q0[r * d + x];
        for (int i = 0; i < NV; ++i) acc[r][i] += qx * kv[i];
      }
    }
    for (int r = 0; r < kScoreRows; ++r)
      for (int i = 0; i < NV; ++i) store(s + (m + r) * kChunk + i * kLanes, acc[r][i]);
  }
  for (; m < M; ++m) {
    vfloat acc[NV] = {};
    const float* qm = q + static_cast<int64_t>(m) * d;
    for (int x = 0; x < d; ++x)
      for (int i = 0; i < NV; ++i) acc[i] += qm[x] * load(kt + x * kChunk + i * kLanes);
    for (int i = 0; i < NV; ++i) store(s + m * kChunk + i * kLanes, acc[i]);
  }
}

// acc[x] = acc[x] * alpha + sum_j p[j] * v[j][x] for x < d, j in [j0, j1).
template <int DT>
inline void accumulate_pv(float* am, float alpha, const float* pr, const float* const* v, int j0, int j1, int d_rt) {
  if constexpr (DT > 0 && DT % kLanes == 0) {
    // The accumulator stays in registers across the chunk (GCC vector extensions:
    // AVX-512, AVX2 or SSE, whatever -march gives).
    constexpr int NV = DT / kLanes;
    vfloat a[NV];
    for (int i = 0; i < NV; ++i) a[i] = load(am + i * kLanes) * alpha;
    for (int j = j0; j < j1; ++j) {
      const float pj = pr[j];
      const float* vr = v[j];
      for (int i = 0; i < NV; ++i) a[i] += pj * load(vr + i * kLanes);
    }
    for (int i = 0; i < NV; ++i) store(am + i * kLanes, a[i]);
  } else {
    const int d = DT ? DT : d_rt;
    for (int x = 0; x < d; ++x) am[x] *= alpha;
    for (int j = j0; j < j1; ++j) {
      const float pj = pr[j];
      const float* vr = v[j];
#pragma omp simd
      for (int x = 0; x < d; ++x) am[x] += pj * vr[x];
    }
  }
}

// R rows at once: acc[r] = acc[r] * alpha[r] + sum_j p[r][j] * v[j] over the union of
// the rows' key ranges (p is zero outside a row's own range), each V row loaded once.
template <int DT, int R>
inline void accumulate_pv_rows(float* acc, const float* alpha, const float* p, const float* const* v,
                               const int* range) {
  constexpr int NV = DT / kLanes;
  int j0 = kChunk, j1 = 0;
  for (int r = 0; r < R; ++r)
    if (range[2 * r] < range[2 * r + 1]) {
      j0 = std::min(j0, range[2 * r]);
      j1 = std::max(j1, range[2 * r + 1]);
    }
  if (j0 >= j1) return;
  vfloat a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = load(acc + r * DT + i * kLanes) * alpha[r];
  for (int j = j0; j < j1; ++j) {
    vfloat vr[NV];
    for (int i = 0; i < NV; ++i) vr[i] = load(v[j] + i * kLanes);
    for (int r = 0; r < R; ++r) {
      const float pj = p[r * kChunk + j];
      for (int i = 0; i < NV; ++i) a[r][i] += pj * vr[i];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) store(acc + r * DT + i * kLanes, a[r][i]);
}

template <typename T, int DT>
void run_unit(const Params& p, const Unit& u, Scratch& w) {
  const int d = DT ? DT : p.head_dim;
  const int G = p.num_heads / p.num_kv_heads;
  const int bs = p.block_size;
  const int nt = u.t1 - u.t0;
  const int M = nt * G;  // rows per KV head: row m = token (m / G), query head (m % G) of the group
  const int nh = u.h1 - u.h0;
  const int ctx = p.context_lens[u.seq];
  const int qs = p.query_start_loc[u.seq];
  const int32_t* table = p.block_tables + static_cast<int64_t>(u.seq) * p.bt_stride;
  const bool capped = p.softcap > 0.0f;

  w.q.resize(static_cast<size_t>(nh) * M * d);
  w.acc.assign(static_cast<size_t>(nh) * M * d, 0.0f);
  w.s.resize(static_cast<size_t>(M) * kChunk);
  w.row_max.assign(static_cast<size_t>(nh) * M, -INFINITY);
  w.row_sum.assign(static_cast<size_t>(nh) * M, 0.0f);
  if (sizeof(T) != sizeof(float)) {
    w.k.resize(static_cast<size_t>(kChunk) * d);
    w.v.resize(static_cast<size_t>(kChunk) * d);
  }
  w.kt.resize(static_cast<size_t>(kChunk) * d);
  w.alpha.resize(M);
  w.range.resize(2 * static_cast<size_t>(M));

  scaled_queries<T>(p, u, d, w.q.data());

  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * d;  // between tokens of one block
  const int64_t block_stride = row_stride * bs;
  const int64_t span_bytes = static_cast<int64_t>(nh) * d * sizeof(T);  // this unit's heads in one row
  const T* kc = static_cast<const T*>(p.k_cache) + static_cast<int64_t>(u.h0) * d;
  const T* vc = static_cast<const T*>(p.v_cache) + static_cast<int64_t>(u.h0) * d;
  const int k_hi = ctx + u.t1;  // keys [k_lo, k_hi) are visible to some row of the tile
  const int k_lo = p.window > 0 ? std::max(0, ctx + u.t0 - p.window + 1) : 0;

  int64_t off[2][kChunk];
  const float* krow[kChunk];
  const float* vrow[kChunk];
  int cur = 0;
  row_offsets(table, k_lo, std::min(kChunk, k_hi - k_lo), bs, block_stride, row_stride, off[cur]);
  for (int c0 = k_lo; c0 < k_hi; c0 += kChunk, cur ^= 1) {
    const int n = std::min(kChunk, k_hi - c0);
    if (c0 + kChunk < k_hi) {  // blocks sit anywhere in the pool: fetch the next chunk while this one is computed
      const int n_next = std::min(kChunk, k_hi - c0 - kChunk);
      row_offsets(table, c0 + kChunk, n_next, bs, block_stride, row_stride, off[cur ^ 1]);
      prefetch_rows(kc, off[cur ^ 1], n_next, span_bytes);
      prefetch_rows(vc, off[cur ^ 1], n_next, span_bytes);
    }
    for (int hh = 0; hh < nh; ++hh) {
      const int64_t head = static_cast<int64_t>(hh) * d;
      if constexpr (sizeof(T) == sizeof(float)) {
        for (int j = 0; j < n; ++j) {
          krow[j] = reinterpret_cast<const float*>(kc + off[cur][j] + head);
          vrow[j] = reinterpret_cast<const float*>(vc + off[cur][j] + head);
        }
      } else {
        for (int j = 0; j < n; ++j) {
          const T* kr = kc + off[cur][j] + head;
          const T* vr = vc + off[cur][j] + head;
          float* kd = w.k.data() + static_cast<int64_t>(j) * d;
          float* vd = w.v.data() + static_cast<int64_t>(j) * d;
#pragma omp simd
          for (int x = 0; x < d; ++x) {
            kd[x] = to_float<T>(kr[x]);
            vd[x] = to_float<T>(vr[x]);
          }
          krow[j] = kd;
          vrow[j] = vd;
        }
      }
      const float* qh = w.q.data() + static_cast<int64_t>(hh) * M * d;
      float* s = w.s.data();
      if (M >= 8)
        scores_transposed<DT>(qh, M, d, krow, n, s, w.kt.data());
      else if constexpr (DT > 0 && DT % kLanes == 0)
        scores_dot_vec<DT>(qh, M, krow, n, s);
      else
        scores_dot<DT>(qh, M, d, krow, n, s);

      // Softmax first (probabilities into s, zero outside each row's keys), then P.V for
      // rows in groups that share every V row load.
      int* range = w.range.data();
      float* alpha = w.alpha.data();
      for (int m = 0; m < M; ++m) {
        const int pos = ctx + u.t0 + m / G;
        const int j_end = std::min(n, pos - c0 + 1);  // causal
        const int j_begin = p.window > 0 ? std::max(0, pos - p.window + 1 - c0) : 0;
        float* sm = s + m * kChunk;
        if (j_begin >= j_end) {
          for (int j = 0; j < n; ++j) sm[j] = 0.0f;
          range[2 * m] = range[2 * m + 1] = 0;
          alpha[m] = 1.0f;
          continue;
        }
        range[2 * m] = j_begin;
        range[2 * m + 1] = j_end;
        if (capped) {
          for (int j = j_begin; j < j_end; ++j) sm[j] = p.softcap * std::tanh(sm[j] / p.softcap) * kLog2e;
        }
        float bmax = -INFINITY;
#pragma omp simd reduction(max : bmax)
        for (int j = j_begin; j < j_end; ++j) bmax = std::max(bmax, sm[j]);
        const int r = hh * M + m;
        const float old_max = w.row_max[r];
        const float new_max = std::max(old_max, bmax);
        alpha[m] = old_max == -INFINITY ? 0.0f : exp2_neg(old_max - new_max);
        float sum = 0.0f;
        for (int j = 0; j < j_begin; ++j) sm[j] = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int j = j_begin; j < j_end; ++j) {
          const float e = exp2_neg(sm[j] - new_max);
          sm[j] = e;
          sum += e;
        }
        for (int j = j_end; j < n; ++j) sm[j] = 0.0f;
        w.row_max[r] = new_max;
        w.row_sum[r] = w.row_sum[r] * alpha[m] + sum;
      }
      float* acc_h = w.acc.data() + static_cast<int64_t>(hh) * M * d;
      int m = 0;
      if constexpr (DT > 0 && DT % kLanes == 0) {
        for (; m + 4 <= M; m += 4) accumulate_pv_rows<DT, 4>(acc_h + m * DT, alpha + m, s + m * kChunk, vrow, range + 2 * m);
        if (M - m == 3) accumulate_pv_rows<DT, 3>(acc_h + m * DT, alpha + m, s + m * kChunk, vrow, range + 2 * m);
        if (M - m == 2) accumulate_pv_rows<DT, 2>(acc_h + m * DT, alpha + m, s + m * kChunk, vrow, range + 2 * m);
        if (M - m >= 2) m = M;
      }
      for (; m < M; ++m)
        if (range[2 * m] < range[2 * m + 1])
          accumulate_pv<DT>(acc_h + static_cast<int64_t>(m) * d, alpha[m], s + m * kChunk, vrow, range[2 * m],
                            range[2 * m + 1], d);
    }
  }

  T* obase = static_cast<T*>(p.out);
  for (int r = 0; r < nh * M; ++r) {
    const int m = r % M;
    const int t = u.t0 + m / G, h = (u.h0 + r / M) * G + m % G;
    T* dst = obase + (static_cast<int64_t>(qs + t) * p.num_heads + h) * d;
    const float* am = w.acc.data() + static_cast<int64_t>(r) * d;
    store_normalized(dst, am, w.row_sum[r], d);
  }
}

}  // namespace
