// Paged attention for the CPU: reads K/V in place through the block table.
//
// One work unit = (sequence, KV head, tile of query tokens). A unit holds every
// query head of its GQA group for every token of its tile, so each K/V row is
// read once per group and used by all of them. It walks the sequence's blocks
// through the block table with an online (flash) softmax, in fp32, whatever the
// cache dtype. Units are spread over OpenMP threads (dynamic: causal prefill
// units differ in size). Plain C interface, called through ctypes. Design: docs/cpu_kernels.md.

// The other entry families are their own translation units in the same library: kv_write.cpp, linear.cpp,
// llama_layer.cpp (build.py compiles them all).

#include "decode.h"
#include "decode_int8.h"
#include "general.h"
#include "prefill.h"

namespace {

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


// One query token per sequence (token s is sequence s); 0 on success, nonzero for unhandled arguments.
int pagedkv_cpu_decode_int8(const float* q, int64_t q_tok_stride, int64_t q_head_stride, const int8_t* k_cache,
                            const int8_t* v_cache, float* out, const int32_t* block_tables, int64_t bt_stride,
                            const int32_t* seq_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, int window, float softcap, int threads) {
  if (num_seqs < 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0)
    return 1;
  // The shared decode parameters: the query token of sequence s is row s at position seq_lens[s] - 1.
  std::vector<int32_t> context(num_seqs), start(num_seqs + 1);
  for (int s = 0; s <= num_seqs; ++s) start[s] = s;
  for (int s = 0; s < num_seqs; ++s) context[s] = seq_lens[s] - 1;
  const Params a{kInt8Cache, q, q_tok_stride, q_head_stride, k_cache, v_cache, out, block_tables, bt_stride,
                 context.data(), start.data(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                 scale, window, softcap};
  threads = std::max(1, threads);
  const bool whole = head_dim % kLanes == 0;
  switch (whole ? head_dim : 0) {
    case 32: pagedkv_int8::run<32>(a, threads); break;
    case 64: pagedkv_int8::run<64>(a, threads); break;
    case 128: pagedkv_int8::run<128>(a, threads); break;
    case 256: pagedkv_int8::run<256>(a, threads); break;
    default: pagedkv_int8::run_general(a, threads); break;
  }
  return 0;
}

}  // extern "C"
