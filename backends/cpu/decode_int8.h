// Decode attention over an int8 KV cache (--kv-cache-dtype int8), for attention.cpp, after the
// float kernels, whose decode machinery it shares (attention.cpp's Params and Unit; decode.h: DecodeScratch,
// prefetch cursor, tree_of_leaves with key-pair leaves, online softmax state), with simd.h's vector layer
// (load_row<int8_t> widens kLanes int8 values in registers).
//
// Why it looks the way it does: decode at long context is memory-bound, so the point is to read 1 byte
// per value instead of 4 and not to lose that to arithmetic. Each row (head_dim int8 values and its scale
// byte, docs/kv_format.md) is widened in registers and used at once by all query heads of its group, whose
// queries are read from L1 rather than held in registers; K rows go in pairs so each query load serves two
// keys (the load ports are the next limit). Scales apply per row, to scores and softmax weights, not per
// value. Design and measurements: docs/cpu_kernels.md. Other head dims take run_general: scalar, per key.

#pragma once

#include "decode.h"

namespace {  // internal linkage, as every kernel header's definitions
namespace pagedkv_int8 {

// A row's scale is the E5M3 code in the byte after its values (docs/kv_format.md, SCALE_BIAS 22): float32
// bits (code << 20) + ((127 - 22) << 23), exact; code 0 is a zero row, code 255 a non-finite one (NaN).
inline float row_scale(const int8_t* row, int head_dim) {
  const uint32_t code = static_cast<uint8_t>(row[head_dim]);
  const uint32_t bits = code == 0 ? 0u : code == 255 ? 0x7fc00000u : (code << 20) + (105u << 23);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Bytes from one cache row (one token, one KV head) to the next: the values and the scale.
inline int64_t row_bytes(int head_dim) { return head_dim + 1; }

constexpr int kKeys = 2 * kLanes;  // keys a step: two shuffle trees, one softmax update and rescale
constexpr int kInt8MaxPass = 4;  // query heads per pass: GB scores x log2(kLanes) tree levels stay in registers

// Vectors of a P.V slice: its GB x SL accumulators, the GB broadcast weights of a key and one widened V
// vector in registers (AVX2: 4 for up to three heads, so each weight is broadcast once for 4 vectors).
constexpr int pv_slice(int nv, int gb) { return nv % 4 == 0 && gb * 5 + 1 <= kRegisters ? 4 : nv % 2 == 0 ? 2 : 1; }

// One step of up to kKeys keys (n valid; rows past n point at kZeroRow, scale 0) for GB query heads of one KV
// head: q [GB][DT] pre-scaled, acc [GB][DT], state hs[GB]; pf advanced once per key and once per P.V slice.
template <int DT, int GB>
inline void step(const float* q, const int8_t* const* kr, const int8_t* const* vr, int n, PrefetchCursor* pf,
                 float softcap, float* acc, DecodeHead* hs) {
  constexpr int NV = DT / kLanes;
  constexpr int SV = kKeys / kLanes;  // score vectors a head
  alignas(64) float kscale[kKeys], vscale[kKeys];
  for (int j = 0; j < kKeys; ++j) {
    kscale[j] = row_scale(kr[j], DT);
    vscale[j] = row_scale(vr[j], DT);
  }
  vfloat s[SV][GB];  // lane j of s[c]: key c * kLanes + j's q . k_int8
  for (int c = 0; c < SV; ++c) {
    auto pair = [&](int input, vfloat* out) {
      const int8_t* k0 = kr[c * kLanes + tree_lane(input)];
      const int8_t* k1 = kr[c * kLanes + tree_lane(input + 1)];
      if (pf != nullptr) {
        pf->issue();
        pf->issue();
      }
      vfloat a0[GB], a1[GB];
      vfloat x0 = load_row<int8_t>(k0), x1 = load_row<int8_t>(k1);
      for (int g = 0; g < GB; ++g) {
        const vfloat qv = load(q + g * DT);
        a0[g] = qv * x0;
        a1[g] = qv * x1;
      }
      for (int i = 1; i < NV; ++i) {
        x0 = load_row<int8_t>(k0 + i * kLanes);
        x1 = load_row<int8_t>(k1 + i * kLanes);
        for (int g = 0; g < GB; ++g) {
          const vfloat qv = load(q + g * DT + i * kLanes);
          a0[g] += qv * x0;
          a1[g] += qv * x1;
        }
      }
      for (int g = 0; g < GB; ++g) out[g] = tree_level<kLanes / 2>(a0[g], a1[g]);
    };
    tree_of_leaves<GB, kLaneBits, 1>(pair, 0, s[c]);
  }

  const vfloat ninf = vfloat{} - INFINITY;
  alignas(64) float weight[GB][kKeys];  // softmax weight x V scale of key j
  float alpha[GB];
  for (int g = 0; g < GB; ++g) {
    vfloat sg[SV];
    vfloat top = ninf;
    for (int c = 0; c < SV; ++c) {
      sg[c] = s[c][g] * load(kscale + c * kLanes);
      if (softcap > 0.0f) {
        alignas(64) float t[kLanes];
        store(t, sg[c]);
        for (int j = 0; j < kLanes; ++j) t[j] = softcap * std::tanh(t[j] / softcap) * kLog2e;
        sg[c] = load(t);
      }
      sg[c] = lane_index() < n - c * kLanes ? sg[c] : ninf;
      top = vmax(top, sg[c]);
    }
    const float old_max = hs[g].max;
    const float new_max = std::max(old_max, max_lanes(top));
    alpha[g] = old_max == -INFINITY ? 0.0f : exp2_neg(old_max - new_max);
    vfloat sum = hs[g].sum * alpha[g];
    for (int c = 0; c < SV; ++c) {
      vfloat pg = exp2_neg_vec(sg[c] - new_max);
      pg = lane_index() < n - c * kLanes ? pg : vfloat{};
      sum += pg;
      store(weight[g] + c * kLanes, pg * load(vscale + c * kLanes));
    }
    hs[g].max = new_max;
    hs[g].sum = sum;
  }

  constexpr int SL = pv_slice(NV, GB);
  for (int i = 0; i < NV; i += SL) {
    if (pf != nullptr) pf->issue();
    vfloat a[GB][SL];
    for (int g = 0; g < GB; ++g)
      for (int x = 0; x < SL; ++x) a[g][x] = load(acc + g * DT + (i + x) * kLanes) * alpha[g];
    for (int j = 0; j < kKeys; ++j) {
      vfloat w[GB];
      for (int g = 0; g < GB; ++g) w[g] = splat(weight[g][j]);
      for (int x = 0; x < SL; ++x) {
        const vfloat vv = load_row<int8_t>(vr[j] + (i + x) * kLanes);
        for (int g = 0; g < GB; ++g) a[g][x] += w[g] * vv;
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int x = 0; x < SL; ++x) store(acc + g * DT + (i + x) * kLanes, a[g][x]);
  }
}

template <int DT>
inline void pass(int gb, const float* q, const int8_t* const* kr, const int8_t* const* vr, int n, PrefetchCursor* pf,
                 float softcap, float* acc, DecodeHead* hs) {
  static_assert(kInt8MaxPass == 4, "pass sizes 1..4");
  switch (gb) {
    case 4: step<DT, 4>(q, kr, vr, n, pf, softcap, acc, hs); break;
    case 3: step<DT, 3>(q, kr, vr, n, pf, softcap, acc, hs); break;
    case 2: step<DT, 2>(q, kr, vr, n, pf, softcap, acc, hs); break;
    default: step<DT, 1>(q, kr, vr, n, pf, softcap, acc, hs); break;
  }
}

// The query token of sequence u.seq (position seq_len - 1) against its visible keys, KV heads [h0, h1):
// kKeys keys a step, the rows kDecodeAhead keys on prefetched into L2 meanwhile (decode.h).
template <int DT>
void run_unit(const Params& a, const Unit& u, DecodeScratch& w) {
  static_assert(DT % kLanes == 0 && DT <= 256, "int8 decode: head dims that are whole vectors");
  const int G = a.num_heads / a.num_kv_heads;
  const int nh = u.h1 - u.h0;
  const int len = a.context_lens[u.seq] + u.t0 + 1;  // keys up to the query token's own
  const int lo = a.window > 0 ? std::max(0, len - a.window) : 0;
  const int64_t row = row_bytes(DT);
  const int64_t token_stride = row * a.num_kv_heads;
  const int64_t block_stride = token_stride * a.block_size;
  const int32_t* table = a.block_tables + static_cast<int64_t>(u.seq) * a.bt_stride;
  const int8_t* kc = static_cast<const int8_t*>(a.k_cache) + u.h0 * row;
  const int8_t* vc = static_cast<const int8_t*>(a.v_cache) + u.h0 * row;

  const int rows = nh * G;  // query heads h0 * G + r
  w.q.resize(static_cast<size_t>(rows) * DT);
  scaled_queries<float>(a, u, DT, w.q.data());  // one token: row r is query head h0 * G + r
  w.acc.assign(static_cast<size_t>(rows) * DT, 0.0f);
  w.head.assign(rows, DecodeHead{-INFINITY, vfloat{}});

  constexpr int kRing = kDecodeAhead / kKeys + 1;
  w.off.resize(static_cast<size_t>(kRing) * kKeys);
  auto offsets = [&](int c0) -> int64_t* { return w.off.data() + ((c0 - lo) / kKeys % kRing) * kKeys; };
  for (int c0 = lo; c0 < std::min(len, lo + kDecodeAhead); c0 += kKeys)
    row_offsets(table, c0, std::min(kKeys, len - c0), a.block_size, block_stride, token_stride, offsets(c0));

  const int passes = (G + kInt8MaxPass - 1) / kInt8MaxPass;  // as even as possible (G = 8: 4 + 4)
  const int gb0 = G / passes + (G % passes != 0 ? 1 : 0);  // the first pass's heads: it advances the cursor
  const int calls = nh * (kKeys + DT / kLanes / pv_slice(DT / kLanes, gb0));  // PrefetchCursor::issue calls a step
  const int span = static_cast<int>(nh * row);                // the unit's bytes of one token, unaligned
  const int lines_per_row = (span + 62) / 64 + 1;
  const int8_t* zero = reinterpret_cast<const int8_t*>(kZeroRow);
  const int8_t* kr[kKeys];
  const int8_t* vr[kKeys];
  for (int c0 = lo; c0 < len; c0 += kKeys) {
    const int n = std::min(kKeys, len - c0);
    const int64_t* off = offsets(c0);
    const int a0 = c0 + kDecodeAhead;
    const int n_ahead = a0 < len ? std::min(kKeys, len - a0) : 0;
    if (n_ahead > 0) row_offsets(table, a0, n_ahead, a.block_size, block_stride, token_stride, offsets(a0));
    PrefetchCursor pf{reinterpret_cast<const char*>(kc), reinterpret_cast<const char*>(vc), offsets(a0), 1,
                      n_ahead, lines_per_row, (n_ahead * lines_per_row + calls - 1) / calls};
    for (int hh = 0; hh < nh; ++hh) {
      for (int j = 0; j < kKeys; ++j) {
        kr[j] = j < n ? kc + off[j] + hh * row : zero;
        vr[j] = j < n ? vc + off[j] + hh * row : zero;
      }
      for (int p = 0, g0 = 0; p < passes; ++p) {
        const int gb = G / passes + (p < G % passes ? 1 : 0);
        const int r = hh * G + g0;
        pass<DT>(gb, w.q.data() + static_cast<int64_t>(r) * DT, kr, vr, n, p == 0 ? &pf : nullptr, a.softcap,
                 w.acc.data() + static_cast<int64_t>(r) * DT, w.head.data() + r);
        g0 += gb;
      }
    }
  }

  float* dst = static_cast<float*>(a.out) + (static_cast<int64_t>(a.query_start_loc[u.seq] + u.t0) * a.num_heads + u.h0 * G) * DT;
  for (int r = 0; r < rows; ++r) {
    const float total = add_lanes(w.head[r].sum);
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = 0; d < DT; ++d) dst[static_cast<int64_t>(r) * DT + d] = w.acc[static_cast<size_t>(r) * DT + d] * inv;
  }
}

template <int DT>
void run(const Params& a, int threads) {
  // One unit a sequence (its KV heads' rows of a token are adjacent); heads apart only when too few to go round.
  const int split = a.num_seqs >= 4 * threads ? 1 : a.num_kv_heads;
  std::vector<Unit> units;
  units.reserve(static_cast<size_t>(a.num_seqs) * split);
  for (int s = 0; s < a.num_seqs; ++s)
    for (int part = 0; part < split; ++part)
      units.push_back({s, 0, 1, part * a.num_kv_heads / split, (part + 1) * a.num_kv_heads / split});
  const int n = static_cast<int>(units.size());
#pragma omp parallel num_threads(threads)
  {
    DecodeScratch w;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) run_unit<DT>(a, units[i], w);
  }
}

// Any head dim: per key, each row widened once into a float buffer for the group's heads.
void run_general(const Params& a, int threads) {
  const int group = a.num_heads / a.num_kv_heads;
  const int dim = a.head_dim;
  const int64_t row = row_bytes(dim);
  const int64_t token_stride = row * a.num_kv_heads;
  const int64_t block_stride = token_stride * a.block_size;
  const int units = a.num_seqs * a.num_kv_heads;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qs(static_cast<size_t>(group) * dim), acc(static_cast<size_t>(group) * dim);
    std::vector<float> scores, wide(dim);
#pragma omp for schedule(dynamic, 1)
    for (int u = 0; u < units; ++u) {
      const int s = u / a.num_kv_heads, kvh = u % a.num_kv_heads;
      const int len = a.context_lens[s] + 1;
      const int lo = a.window > 0 ? std::max(0, len - a.window) : 0;
      const int n = len - lo;
      const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.bt_stride;
      for (int g = 0; g < group; ++g) {
        const float* src = static_cast<const float*>(a.q) + a.query_start_loc[s] * a.q_tok_stride +
                           static_cast<int64_t>(kvh * group + g) * a.q_head_stride;
        for (int d = 0; d < dim; ++d) qs[g * dim + d] = src[d] * a.scale;
      }
      scores.resize(static_cast<size_t>(group) * std::max(n, 1));
      std::vector<float> maxes(group, -INFINITY), sums(group, 0.0f);
      auto row_at = [&](const int8_t* cache, int pos) {
        return cache + static_cast<int64_t>(table[pos / a.block_size]) * block_stride +
               (pos % a.block_size) * token_stride + kvh * row;
      };
      for (int i = 0; i < n; ++i) {
        const int8_t* k = row_at(static_cast<const int8_t*>(a.k_cache), lo + i);
        const float ks = row_scale(k, dim);
        for (int d = 0; d < dim; ++d) wide[d] = static_cast<float>(k[d]);
        for (int g = 0; g < group; ++g) {
          float sc = 0.0f;
#pragma omp simd reduction(+ : sc)
          for (int d = 0; d < dim; ++d) sc += qs[g * dim + d] * wide[d];
          sc *= ks;
          if (a.softcap > 0.0f) sc = a.softcap * std::tanh(sc / a.softcap);
          scores[g * n + i] = sc;
          maxes[g] = std::max(maxes[g], sc);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int g = 0; g < group; ++g)
        for (int i = 0; i < n; ++i) {
          const float e = std::exp(scores[g * n + i] - maxes[g]);
          scores[g * n + i] = e;
          sums[g] += e;
        }
      for (int i = 0; i < n; ++i) {
        const int8_t* v = row_at(static_cast<const int8_t*>(a.v_cache), lo + i);
        const float vs = row_scale(v, dim);
        for (int d = 0; d < dim; ++d) wide[d] = static_cast<float>(v[d]);
        for (int g = 0; g < group; ++g) {
          const float wgt = scores[g * n + i] * vs;
#pragma omp simd
          for (int d = 0; d < dim; ++d) acc[g * dim + d] += wgt * wide[d];
        }
      }
      for (int g = 0; g < group; ++g) {
        float* dst = static_cast<float*>(a.out) + (static_cast<int64_t>(a.query_start_loc[s]) * a.num_heads + kvh * group + g) * dim;
        const float inv = sums[g] > 0.0f ? 1.0f / sums[g] : 0.0f;
        for (int d = 0; d < dim; ++d) dst[d] = acc[g * dim + d] * inv;
      }
    }
  }
}

}  // namespace pagedkv_int8
}  // namespace
