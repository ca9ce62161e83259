// Paged attention for the CPU: reads K/V in place through the block table.
//
// One work unit = (sequence, KV head, tile of query tokens). A unit holds every
// query head of its GQA group for every token of its tile, so each K/V row is
// read once per group and used by all of them. It walks the sequence's blocks
// through the block table with an online (flash) softmax, in fp32, whatever the
// cache dtype. Units are spread over OpenMP threads (dynamic: causal prefill
// units differ in size). Plain C interface, called through ctypes. Design: docs/cpu_kernels.md.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // the int8 row widening in simd.h
#endif

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, NaN kept NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// 2^x for x <= 0, written with arithmetic and bit operations only so that loops
// over it vectorize: x = n + f with |f| <= 0.5, 2^f by its Taylor series in
// f*ln2 to degree 6 (relative error ~1e-7), 2^n through the exponent bits.
__attribute__((always_inline)) inline float exp2_neg(float x) {
  x = std::max(x, -126.0f);
  const float n = std::nearbyint(x);
  const float r = (x - n) * kLn2;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

constexpr int kInt8Cache = 2;  // Params::dtype of the int8-cache decode (decode_int8.h)

struct Params {
  int dtype;  // 0 = float32, 1 = bfloat16 (query, caches and output); kInt8Cache: int8 rows, fp32 q/out
  const void* q;
  int64_t q_tok_stride, q_head_stride;  // in elements; head_dim is contiguous
  const void* k_cache;
  const void* v_cache;
  void* out;  // [T, H, D] contiguous
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* context_lens;
  const int32_t* query_start_loc;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int window;  // 0 = off; else keys with pos > q_pos - window
  float softcap;  // 0 = off
};

struct Unit {
  int seq, t0, t1, h0, h1;  // query tokens [t0, t1) of one sequence, KV heads [h0, h1)
};

#include "simd.h"

// 2^x lane by lane, the polynomial of exp2_neg; lanes below -126 (masked keys are -inf) give exactly 0.
inline vfloat exp2_neg_vec(vfloat x) {
  const vfloat lo = splat(-126.0f);
  const vint keep = x > lo;
  x = keep ? x : lo;
  const vfloat magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to nearest
  const vfloat n = (x + magic) - magic;
  const vfloat r = (x - n) * kLn2;
  vfloat p = splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return keep ? p * scale : vfloat{};
}

struct Scratch {
  std::vector<float> q, acc, s, row_max, row_sum, k, v, kt, alpha;
  std::vector<int> range;
};

template <typename T>
inline float to_float(T x);
template <>
inline float to_float<float>(float x) { return x; }
template <>
inline float to_float<uint16_t>(uint16_t x) { return bf16_to_float(x); }

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

// Element offsets of key rows [c0, c0 + n) of a sequence (head 0), through its block table.
inline void row_offsets(const int32_t* table, int c0, int n, int bs, int64_t block_stride, int64_t row_stride,
                        int64_t* off) {
  for (int j = 0; j < n; ++j) {
    const int pos = c0 + j;
    off[j] = static_cast<int64_t>(table[pos / bs]) * block_stride + static_cast<int64_t>(pos % bs) * row_stride;
  }
}

template <typename T>
inline void prefetch_rows(const T* base, const int64_t* off, int n, int64_t bytes) {
  for (int j = 0; j < n; ++j) {
    const char* r = reinterpret_cast<const char*>(base + off[j]);
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(r + c, 0, 1);
  }
}

// The unit's query rows as fp32 in q (d floats each, KV head major; row m of a KV head is token m / G,
// query head m % G of its group), pre-scaled: by the softmax scale, and by log2(e) too unless the
// scores are soft-capped (capping needs natural units; the exponentials are 2^x).
template <typename T>
void scaled_queries(const Params& p, const Unit& u, int d, float* q) {
  const int G = p.num_heads / p.num_kv_heads;
  const int M = (u.t1 - u.t0) * G;
  const int nh = u.h1 - u.h0;
  const float qscale = p.softcap > 0.0f ? p.scale : p.scale * kLog2e;
  const T* qbase = static_cast<const T*>(p.q) + static_cast<int64_t>(p.query_start_loc[u.seq]) * p.q_tok_stride;
  for (int r = 0; r < nh * M; ++r) {
    const int m = r % M;
    const int t = u.t0 + m / G, h = (u.h0 + r / M) * G + m % G;
    const T* src = qbase + t * p.q_tok_stride + h * p.q_head_stride;
    float* dst = q + static_cast<int64_t>(r) * d;
    for (int x = 0; x < d; ++x) dst[x] = to_float<T>(src[x]) * qscale;
  }
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
    const float inv = w.row_sum[r] > 0.0f ? 1.0f / w.row_sum[r] : 0.0f;
    for (int x = 0; x < d; ++x) {
      const float o = am[x] * inv;
      if constexpr (sizeof(T) == sizeof(float))
        dst[x] = o;
      else
        dst[x] = float_to_bf16(o);
    }
  }
}

#include "decode.h"
#include "prefill.h"
#include "linear.h"
#include "llama_block.h"

// A decode-only step on several threads: each thread takes a contiguous range of the units holding an equal share
// of their keys and runs it in order, so every unit's last steps prefetch the next one's first rows (with
// dynamic scheduling the next unit is unknown and each would start on cold misses).
template <typename T, int DT>
void run_decode_ranges(const Params& p, const std::vector<Unit>& units, int threads) {
  const int n = static_cast<int>(units.size());
  std::vector<int64_t> upto(n + 1, 0);  // keys of units [0, i)
  for (int i = 0; i < n; ++i) {
    const DecodeRows<T, DT> rows(p, units[i]);
    upto[i + 1] = upto[i] + (rows.k_hi - rows.k_lo) * (units[i].h1 - units[i].h0);
  }
  std::vector<int> bound(threads + 1, n);  // thread t runs units [bound[t], bound[t + 1])
  bound[0] = 0;
  for (int t = 1; t < threads; ++t)
    bound[t] = static_cast<int>(std::lower_bound(upto.begin(), upto.end(), upto[n] * t / threads) - upto.begin());
#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int t = 0; t < threads; ++t) {
    DecodeScratch dw;
    for (int i = bound[t]; i < bound[t + 1]; ++i)
      run_decode_unit<T, DT>(p, units[i], i + 1 < bound[t + 1] ? &units[i + 1] : nullptr, dw);
  }
}

// Decode units (one query token) take the decode kernel, units of many query rows (prefill) the
// prefill path, when the head dim is whole vectors; anything else the general run_unit.
template <typename T, int DT>
void run_all(const Params& p, const std::vector<Unit>& units, int threads) {
  const int n = static_cast<int>(units.size());
  const int group = p.num_heads / p.num_kv_heads;
  if constexpr (DT > 0 && DT % kLanes == 0) {
    const bool decode_only =
        std::all_of(units.begin(), units.end(), [](const Unit& u) { return u.t1 - u.t0 == 1; });
    if (threads > 1 && decode_only && n >= 2 * threads) return run_decode_ranges<T, DT>(p, units, threads);
  }
#pragma omp parallel num_threads(threads)
  {
    Scratch w;
    DecodeScratch dw;
    PrefillScratch pw;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) {
      if constexpr (DT > 0 && DT % kLanes == 0) {
        if (units[i].t1 - units[i].t0 == 1) {
          // With one thread the next unit is i + 1; with more, dynamic scheduling makes it a guess
          // whose misses would cost bandwidth, so no hint.
          const bool next = threads == 1 && i + 1 < n && units[i + 1].t1 - units[i + 1].t0 == 1;
          run_decode_unit<T, DT>(p, units[i], next ? &units[i + 1] : nullptr, dw);
          continue;
        }
        if ((units[i].t1 - units[i].t0) * group >= kPrefillMinRows) {
          run_prefill_unit<T, DT>(p, units[i], pw);
          continue;
        }
      }
      run_unit<T, DT>(p, units[i], w);
    }
  }
}

template <typename T>
void dispatch_dim(const Params& p, const std::vector<Unit>& units, int threads) {
  switch (p.head_dim) {
    case 64: run_all<T, 64>(p, units, threads); break;
    case 128: run_all<T, 128>(p, units, threads); break;
    case 32: run_all<T, 32>(p, units, threads); break;
    case 256: run_all<T, 256>(p, units, threads); break;
    default: run_all<T, 0>(p, units, threads); break;
  }
}

}  // namespace

extern "C" {

// The build's vector width in floats (16, 8 or 4) and its name: what build.py checks it loaded.
int pagedkv_cpu_lanes() { return kLanes; }
const char* pagedkv_cpu_isa() { return kIsaName; }

// Scatters the new K and V rows of a step into their cache slots (a slot < 0 is skipped). A row is one token's
// heads x head_dim elements, contiguous; tokens are k_stride / v_stride elements apart. dtype 0: fp32, 1: bf16.
// Returns 0, or nonzero (nothing written) for a slot past the cache's num_slots.
int pagedkv_cpu_write_kv(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache,
                         void* v_cache, const int64_t* slots, int64_t tokens, int64_t row, int64_t num_slots) {
  if ((dtype != 0 && dtype != 1) || tokens < 0 || row <= 0) return 1;
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= num_slots) return 2;  // (nothing written: the caller's reference path raises the error)
  const int64_t size = dtype == 0 ? 4 : 2;
  const char* ks = static_cast<const char*>(k);
  const char* vs = static_cast<const char*>(v);
  char* kc = static_cast<char*>(k_cache);
  char* vc = static_cast<char*>(v_cache);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * row * size, ks + t * k_stride * size, row * size);
    std::memcpy(vc + slots[t] * row * size, vs + t * v_stride * size, row * size);
  }
  return 0;
}

// The packed fp32 linear (linear.h): the panel width its packed weights have, and y[rows, n] = x[rows, k]
// W^T + bias (bias may be null). Returns 0, or nonzero for sizes it does not take.
int pagedkv_cpu_linear_panel() { return kNr; }
int pagedkv_cpu_linear(const float* x, int64_t rows, int64_t k, const float* packed, const float* bias, int64_t n,
                       float* y, int threads) {
  if (rows < 0 || k <= 0 || n <= 0 || k > INT32_MAX / kNr || n > INT32_MAX) return 1;
  linear_rows_all(x, k, rows, static_cast<int>(k), packed, bias, static_cast<int>(n), y, false,
                  std::max(1, threads));
  return 0;
}

// The packed linear on bf16 weights (linear.h's bf16 panels, [panel][k / 2][panel width][2], K padded to even):
// y[rows, n] = x[rows, k] W^T + bias in fp32, x and bias fp32. Returns 0, or nonzero for sizes it does not take.
int pagedkv_cpu_linear_bf16(const float* x, int64_t rows, int64_t k, const uint16_t* packed, const float* bias,
                            int64_t n, float* y, int threads) {
  if (rows < 0 || k <= 0 || n <= 0 || k > INT32_MAX / kNr || n > INT32_MAX) return 1;
  std::vector<Bf16Weights::X> buf;
  linear_from_f32<Bf16Weights>(x, k, rows, k, packed, bias, static_cast<int>(n), y, false, std::max(1, threads), buf);
  return 0;
}
// How this build multiplies bf16 weights: "avx512-bf16 vdpbf16ps" or "widened in registers".
const char* pagedkv_cpu_linear_bf16_path() { return kBf16Path; }

// Returns 0 on success, nonzero for arguments the kernel does not handle. phases: which sequences
// to compute (1: those with one query token, 2: those with more, 3: all); the others' output rows are
// left alone, for the caller to fill (backend.py sends prefills to torch where that is faster).
int pagedkv_cpu_attend(int dtype, const void* q, int64_t q_tok_stride, int64_t q_head_stride, const void* k_cache,
                       const void* v_cache, void* out, const int32_t* block_tables, int64_t bt_stride,
                       const int32_t* context_lens, const int32_t* query_start_loc, int num_seqs, int num_heads,
                       int num_kv_heads, int head_dim, int block_size, float scale, int window, float softcap,
                       int query_tile, int threads, int phases) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0) return 1;
  if (dtype != 0 && dtype != 1) return 2;
  Params p{dtype, q, q_tok_stride, q_head_stride, k_cache, v_cache, out, block_tables, bt_stride,
           context_lens, query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
           scale, window, softcap};
  const int tile = std::max(1, query_tile);
  threads = std::max(1, threads);
  // A unit takes every KV head of its tokens, so it reads each block as one contiguous
  // stretch; heads are split apart only when there are too few units to go round.
  auto wanted = [&](int len) { return (phases & (len == 1 ? 1 : 2)) != 0; };
  int tiles = 0;
  for (int s = 0; s < num_seqs; ++s) {
    const int len = query_start_loc[s + 1] - query_start_loc[s];
    if (wanted(len)) tiles += (len + tile - 1) / tile;
  }
  const int head_split = tiles >= 4 * threads ? 1 : num_kv_heads;
  std::vector<Unit> units;
  units.reserve(static_cast<size_t>(tiles) * head_split);
  for (int s = 0; s < num_seqs; ++s) {
    const int len = query_start_loc[s + 1] - query_start_loc[s];
    if (!wanted(len)) continue;
    for (int t0 = 0; t0 < len; t0 += tile)
      for (int part = 0; part < head_split; ++part)
        units.push_back({s, t0, std::min(len, t0 + tile), part * num_kv_heads / head_split,
                         (part + 1) * num_kv_heads / head_split});
  }
  if (dtype == 0)
    dispatch_dim<float>(p, units, threads);
  else
    dispatch_dim<uint16_t>(p, units, threads);
  return 0;
}

// A Llama layer's dense parts (llama_block.h). attention inputs: h [rows, d] -> qkv [rows, nq + 2 nkv] (q and k
// rotated by cos/sin [rows, head_dim]), through the scratch xn [min(rows, kRowChunk), d]; wqkv is [Wq; Wk; Wv]
// packed.
int pagedkv_cpu_llama_attention_inputs(const float* h, int64_t rows, int64_t d, const float* norm_weight, float eps,
                                       const float* wqkv, int64_t nq, int64_t nkv, int64_t head_dim,
                                       const float* cos, const float* sin, float* xn, float* qkv, int threads) {
  return llama_attention_inputs<F32Weights>(h, rows, d, norm_weight, eps, wqkv, nq, nkv, head_dim, cos, sin, xn, qkv,
                                            threads);
}
// The same on bf16 weights (linear.h's bf16 panels); activations, norm weights, cos/sin and outputs stay fp32.
int pagedkv_cpu_llama_attention_inputs_bf16(const float* h, int64_t rows, int64_t d, const float* norm_weight,
                                            float eps, const uint16_t* wqkv, int64_t nq, int64_t nkv,
                                            int64_t head_dim, const float* cos, const float* sin, float* xn,
                                            float* qkv, int threads) {
  return llama_attention_inputs<Bf16Weights>(h, rows, d, norm_weight, eps, wqkv, nq, nkv, head_dim, cos, sin, xn,
                                             qkv, threads);
}

// MLP block: h [rows, d] += attn [rows, nq] Wo^T; xn = RMSNorm(h); gu = xn [Wg; Wu]^T [rows, 2 inter];
// h += (SiLU(gate) * up) Wd^T. h is updated in place; xn [min(rows, kRowChunk), d] and gu [min(rows,
// kRowChunk), 2 inter] are scratch.
int pagedkv_cpu_llama_mlp(float* h, int64_t rows, int64_t d, const float* attn, int64_t nq, const float* wo,
                          const float* norm_weight, float eps, const float* wgu, int64_t inter, const float* wdown,
                          float* xn, float* gu, int threads) {
  return llama_mlp<F32Weights>(h, rows, d, attn, nq, wo, norm_weight, eps, wgu, inter, wdown, xn, gu, threads);
}
// The same on bf16 weights; h, attn, the norm weight and the scratch stay fp32.
int pagedkv_cpu_llama_mlp_bf16(float* h, int64_t rows, int64_t d, const float* attn, int64_t nq, const uint16_t* wo,
                               const float* norm_weight, float eps, const uint16_t* wgu, int64_t inter,
                               const uint16_t* wdown, float* xn, float* gu, int threads) {
  return llama_mlp<Bf16Weights>(h, rows, d, attn, nq, wo, norm_weight, eps, wgu, inter, wdown, xn, gu, threads);
}

// Rows of the layer calls' scratch (xn, gu): they go through kRowChunk rows at a time.
int pagedkv_cpu_llama_scratch_rows() { return kRowChunk; }

}  // extern "C"

#include "decode_int8.h"  // the int8-cache decode kernel (--kv-cache-dtype int8), on its own
#include "quant_linear.h"  // the linear on GGUF-block weights (quantization gguf), on its own
