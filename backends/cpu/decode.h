// The decode kernel: work units with one query token (every decode step, and the
// last token of a prefill tile). Included by attention.cpp inside its anonymous
// namespace, after the helpers it uses (vfloat, load, store, Params, Unit,
// exp2_neg, row_offsets, kLog2e, bf16 conversions).
//
// Why it is separate from run_unit: with one query token a unit has only the G query
// heads of each KV head (3 for SmolLM2), so the kernel is bound by the work per K/V
// row and by how well the memory traffic overlaps it, not by reuse across query rows:
// - keys go 16 at a time; each K row is loaded once for all the group's query heads,
//   and the 16 keys' dot products are summed by one shuffle tree per head, built
//   as the keys come (a few vectors live, not 16 per head);
// - the 16 scores stay in a vector: max, exp2 and the running sum are vector ops,
//   one rescale of the accumulators per 16 keys; the sum is kept per lane and
//   reduced once at the end;
// - P.V loads each V row once for all the group's query heads (accumulators in
//   registers, probabilities broadcast from a 16-float buffer);
// - each K/V row of the unit's heads is prefetched kDecodeAhead keys ahead, one row
//   per row computed, so the loads overlap the arithmetic (a burst of a whole chunk's
//   prefetches stalls the core until its misses return);
// - bf16 rows are widened in registers, never copied.
// Query heads of a group go in passes of at most 4 (their accumulators and queries
// fill the vector registers); the passes share the 16 rows while they are in L1.

constexpr int kDecodeKeys = 16;   // keys per step: one shuffle tree
#ifndef AHEAD
#define AHEAD 32
#endif
#ifndef SPLITJ
#define SPLITJ 2
#endif
#ifndef PFSTEP
#define PFSTEP 1
#endif
#ifndef PFLOC
#define PFLOC 1
#endif
constexpr int kDecodeAhead = AHEAD;  // prefetch distance in keys (a multiple of kDecodeKeys)

typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// Stand-in for the keys past the end of a partial step: zeros, never the cache's unused slots.
alignas(64) const float kZeroRow[256] = {};

template <typename T>
inline vfloat load_row(const T* p);
template <>
inline vfloat load_row<float>(const float* p) {
  return load(p);
}
template <>
inline vfloat load_row<uint16_t>(const uint16_t* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof(h));
  const vuint wide = __builtin_convertvector(h, vuint) << 16;
  vfloat f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// The shuffle tree of sum_lanes_of_16, one level at a time: level L adds pairs of
// partial sums 16 >> L lanes apart and interleaves two inputs' results.
inline vfloat tree1(vfloat a, vfloat b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline vfloat tree2(vfloat a, vfloat b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline vfloat tree3(vfloat a, vfloat b) {
  return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline vfloat tree4(vfloat a, vfloat b) {
  return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
// Tree input i comes out in lane kTreeInput[i] (a bit reversal, its own inverse).

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

inline float max_lanes(vfloat v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

inline float add_lanes(vfloat v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// exp2_neg on 16 lanes (same polynomial); rounds by the 1.5 * 2^23 trick, exact for |x| < 2^22.
inline vfloat exp2_neg_lanes(vfloat x) {
  const vfloat lo = vfloat{} - 126.0f;
  x = x < lo ? lo : x;
  const vfloat n = (x + 12582912.0f) - 12582912.0f;
  const vfloat r = (x - n) * kLn2;
  vfloat p = vfloat{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Online-softmax state of one query head: running max (log2 units) and per-lane running sum.
struct DecodeHead {
  float max;
  vfloat sum;
};

struct DecodeScratch {
  std::vector<float> q, acc, prob;
  std::vector<DecodeHead> head;
  std::vector<vfloat> quad;        // level-2 partial sums of the step's scores: [4][rows]
  std::vector<int64_t> off;        // element offsets of the rows of the steps in flight (ring)
};

// Key j of a step is tree input j, so it comes out in lane kTreeInput[j] (a bit reversal).
constexpr vint kKeyOfLane = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

template <typename T>
inline void prefetch_span(const T* p, int bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 0, PFLOC);
}

// Scores of 4 keys (rows kr) for GB query heads (q [GB][DT], pre-scaled), summed two
// levels down the shuffle tree: out[g] holds them in 4 lanes' partial sums each. pk/pv
// (or nullptr): the rows of the same head to prefetch, one per key.
template <typename T, int DT, int GB>
inline void quad_scores(const float* q, const T* const* kr, const T* const* pk, const T* const* pv, vfloat* out) {
  constexpr int NV = DT / kLanes;
  vfloat qv[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) qv[g][i] = load(q + g * DT + i * kLanes);
  vfloat d[4][GB];
  for (int j = 0; j < 4; ++j) {
    if (j < SPLITJ && pk != nullptr && pk[j] != nullptr) {
      prefetch_span(pk[j], DT * sizeof(T));
      prefetch_span(pv[j], DT * sizeof(T));
    }
    vfloat kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = load_row<T>(kr[j] + i * kLanes);
    for (int g = 0; g < GB; ++g) {
      vfloat a = qv[g][0] * kv[0];
      for (int i = 1; i < NV; ++i) a += qv[g][i] * kv[i];
      d[j][g] = a;
    }
  }
  for (int g = 0; g < GB; ++g) out[g] = tree2(tree1(d[0][g], d[1][g]), tree1(d[2][g], d[3][g]));
}

// acc[g] += p[g][key] * v[key] for the 4 keys of quad qd (rows vr), GB query heads; prob
// holds each head's 16 probabilities in tree lane order.
template <typename T, int DT, int GB>
inline void quad_pv(const float* prob, int qd, const T* const* vr, const T* const* pk, const T* const* pv, float* acc) {
  constexpr int NV = DT / kLanes;
  vfloat a[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = load(acc + g * DT + i * kLanes);
  for (int j = 0; j < 4; ++j) {
    const int lane = kTreeInput[4 * qd + j];
    if (j >= SPLITJ && pk != nullptr && pk[j] != nullptr) {
      prefetch_span(pk[j], DT * sizeof(T));
      prefetch_span(pv[j], DT * sizeof(T));
    }
    vfloat vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load_row<T>(vr[j] + i * kLanes);
    for (int g = 0; g < GB; ++g) {
      const float pj = prob[g * kDecodeKeys + lane];
      for (int i = 0; i < NV; ++i) a[g][i] += pj * vv[i];
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NV; ++i) store(acc + g * DT + i * kLanes, a[g][i]);
}

template <typename T, int DT>
inline void quad_scores_n(int gb, const float* q, const T* const* kr, const T* const* pk, const T* const* pv,
                          vfloat* out) {
  switch (gb) {
    case 1: quad_scores<T, DT, 1>(q, kr, pk, pv, out); break;
    case 2: quad_scores<T, DT, 2>(q, kr, pk, pv, out); break;
    case 3: quad_scores<T, DT, 3>(q, kr, pk, pv, out); break;
    default: quad_scores<T, DT, 4>(q, kr, pk, pv, out); break;
  }
}

template <typename T, int DT>
inline void quad_pv_n(int gb, const float* prob, int qd, const T* const* vr, const T* const* pk, const T* const* pv,
                      float* acc) {
  switch (gb) {
    case 1: quad_pv<T, DT, 1>(prob, qd, vr, pk, pv, acc); break;
    case 2: quad_pv<T, DT, 2>(prob, qd, vr, pk, pv, acc); break;
    case 3: quad_pv<T, DT, 3>(prob, qd, vr, pk, pv, acc); break;
    default: quad_pv<T, DT, 4>(prob, qd, vr, pk, pv, acc); break;
  }
}

// The online softmax of one query head over one step: scores from the four quads'
// partial sums, keys past n masked; probabilities (tree lane order) into prob, the
// accumulator rescaled.
template <int DT>
inline void step_softmax(const vfloat* quad, int stride, int n, float softcap, DecodeHead& hs, float* prob,
                         float* acc) {
  vfloat s = tree4(tree3(quad[0], quad[stride]), tree3(quad[2 * stride], quad[3 * stride]));
  if (softcap > 0.0f) {
    alignas(64) float t[kDecodeKeys];
    store(t, s);
    for (int j = 0; j < kDecodeKeys; ++j) t[j] = softcap * std::tanh(t[j] / softcap) * kLog2e;
    s = load(t);
  }
  const vint valid = kKeyOfLane < n;
  s = valid ? s : vfloat{} - INFINITY;
  const float old_max = hs.max;
  const float new_max = std::max(old_max, max_lanes(s));
  vfloat pr = exp2_neg_lanes(s - new_max);
  pr = valid ? pr : vfloat{};
  store(prob, pr);
  hs.max = new_max;
  if (old_max == new_max) {
    hs.sum += pr;
    return;
  }
  const float alpha = old_max == -INFINITY ? 0.0f : exp2_neg(old_max - new_max);
  hs.sum = hs.sum * alpha + pr;
  for (int i = 0; i < DT / kLanes; ++i) store(acc + i * kLanes, load(acc + i * kLanes) * alpha);
}

// One query token (position context_len + t0) against keys [k_lo, pos] of KV heads [h0, h1).
// Keys go in steps of 16; within a step, in quads of 4 rows, each quad's rows read for
// all the unit's heads before the next: memory is read nearly in address order, which
// keeps the hardware prefetchers working beside the software prefetches (measured: a
// head at a time through the whole step reads ~25% slower).
template <typename T, int DT>
void run_decode_unit(const Params& p, const Unit& u, DecodeScratch& w) {
  static_assert(DT % kLanes == 0 && DT <= 256, "decode kernel: head dims that are whole vectors");
  constexpr int NV = DT / kLanes;
  // Query heads per pass: their queries and accumulators stay in registers.
  constexpr int kMaxPass = NV <= 4 ? 4 : (NV <= 8 ? 2 : 1);
  const int G = p.num_heads / p.num_kv_heads;
  const int nh = u.h1 - u.h0;
  const int bs = p.block_size;
  const int pos = p.context_lens[u.seq] + u.t0;
  const int qs = p.query_start_loc[u.seq];
  const int32_t* table = p.block_tables + static_cast<int64_t>(u.seq) * p.bt_stride;
  const bool capped = p.softcap > 0.0f;
  const float qscale = capped ? p.scale : p.scale * kLog2e;
  const int k_lo = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;
  const int k_hi = pos + 1;

  const int rows = nh * G;  // query heads of the unit, KV head major
  w.q.resize(static_cast<size_t>(rows) * DT);
  w.acc.assign(static_cast<size_t>(rows) * DT, 0.0f);
  w.prob.resize(static_cast<size_t>(rows) * kDecodeKeys);
  w.head.assign(rows, DecodeHead{-INFINITY, vfloat{}});
  w.quad.resize(static_cast<size_t>(4) * rows);
  const T* qbase = static_cast<const T*>(p.q) + (qs + u.t0) * p.q_tok_stride;
  for (int r = 0; r < rows; ++r) {
    const T* src = qbase + (u.h0 * G + r) * p.q_head_stride;
    for (int x = 0; x < DT; ++x) w.q[static_cast<size_t>(r) * DT + x] = to_float<T>(src[x]) * qscale;
  }

  const int passes = (G + kMaxPass - 1) / kMaxPass;  // as even as possible: G = 7 -> 4 + 3
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * DT;
  const int64_t block_stride = row_stride * bs;
  const T* kc = static_cast<const T*>(p.k_cache) + static_cast<int64_t>(u.h0) * DT;
  const T* vc = static_cast<const T*>(p.v_cache) + static_cast<int64_t>(u.h0) * DT;
  const T* zero = reinterpret_cast<const T*>(kZeroRow);
  constexpr int kRing = kDecodeAhead / kDecodeKeys + 1;
  w.off.resize(static_cast<size_t>(kRing) * kDecodeKeys);
  auto offsets = [&](int c0) -> int64_t* { return w.off.data() + ((c0 - k_lo) / kDecodeKeys % kRing) * kDecodeKeys; };
  for (int c0 = k_lo; c0 < std::min(k_hi, k_lo + kDecodeAhead); c0 += kDecodeKeys)
    row_offsets(table, c0, std::min(kDecodeKeys, k_hi - c0), bs, block_stride, row_stride, offsets(c0));

  const T* kr[4];
  const T* vr[4];
  const T* pk[4];
  const T* pv[4];
  for (int c0 = k_lo; c0 < k_hi; c0 += kDecodeKeys) {
    const int n = std::min(kDecodeKeys, k_hi - c0);
    const int64_t* off = offsets(c0);
    const int a0 = c0 + kDecodeAhead;  // the step whose rows this one prefetches
    const int n_ahead = a0 < k_hi ? std::min(kDecodeKeys, k_hi - a0) : 0;
    if (n_ahead > 0) row_offsets(table, a0, n_ahead, bs, block_stride, row_stride, offsets(a0));
    const int64_t* off_ahead = offsets(a0);

    for (int qd = 0; qd < 4; ++qd) {
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t head = static_cast<int64_t>(hh) * DT;
        for (int j = 0; j < 4; ++j) {
          const int key = 4 * qd + j;
          kr[j] = key < n ? kc + off[key] + head : zero;
          pk[j] = key < n_ahead ? kc + off_ahead[key] + head : nullptr;
          pv[j] = key < n_ahead ? vc + off_ahead[key] + head : nullptr;
        }
        for (int pass = 0, g0 = 0; pass < passes; ++pass) {
          const int gb = G / passes + (pass < G % passes ? 1 : 0);
          const int r = hh * G + g0;
          quad_scores_n<T, DT>(gb, w.q.data() + static_cast<int64_t>(r) * DT, kr, pass == 0 ? pk : nullptr, pv,
                               w.quad.data() + qd * rows + r);
          g0 += gb;
        }
      }
    }
    for (int r = 0; r < rows; ++r)
      step_softmax<DT>(w.quad.data() + r, rows, n, p.softcap, w.head[r], w.prob.data() + r * kDecodeKeys,
                       w.acc.data() + static_cast<int64_t>(r) * DT);
    for (int qd = 0; qd < 4; ++qd) {
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t head = static_cast<int64_t>(hh) * DT;
        for (int j = 0; j < 4; ++j) {
          const int key = 4 * qd + j;
          vr[j] = key < n ? vc + off[key] + head : zero;
          pk[j] = key < n_ahead ? kc + off_ahead[key] + head : nullptr;
          pv[j] = key < n_ahead ? vc + off_ahead[key] + head : nullptr;
        }
        for (int pass = 0, g0 = 0; pass < passes; ++pass) {
          const int gb = G / passes + (pass < G % passes ? 1 : 0);
          const int r = hh * G + g0;
          quad_pv_n<T, DT>(gb, w.prob.data() + r * kDecodeKeys, qd, vr, pass == 0 ? pk : nullptr, pv,
                           w.acc.data() + static_cast<int64_t>(r) * DT);
          g0 += gb;
        }
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
