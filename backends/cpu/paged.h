// What every attention kernel knows of a call: its parameters (Params), its work units (Unit), and how a unit
// finds its rows through the block table and reads its queries. Included by general.h, decode.h, prefill.h.

#pragma once

#include "numerics.h"

namespace {

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

}  // namespace
