// Decode attention over an int8 KV cache (--kv-cache-dtype int8), included by attention.cpp.
//
// Kept apart from the float kernels on purpose: it shares nothing with them but the C interface style.
// A cache row is head_dim int8 values followed by that row's bfloat16 scale (core/kv/kv_dtype.py), rows
// of head_dim + 2 bytes. Decode at long context is memory-bound, so the point is to read 1 byte per value
// instead of 4: the values are widened to float in registers, and each row's scale is applied once per
// row, not per value: score = (q . k_int8) * k_scale, and the softmax weight is multiplied by v_scale
// before it scales the int8 V row. One work item is a (sequence, KV head): its G query heads share every
// K/V row it reads. Queries are float32, pre-scaled by `scale`; the output is float32.

namespace pagedkv_int8 {

inline float row_scale(const int8_t* row, int head_dim) {
  uint16_t bits;
  std::memcpy(&bits, row + head_dim, 2);
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

// A row's D int8 values widened to float once (D known at compile time for the common head dims, else
// `dim`), then used by all G query heads of the group.
template <int D>
inline void widen(float* out, const int8_t* row, int dim) {
  const int n = D > 0 ? D : dim;
#pragma omp simd
  for (int d = 0; d < n; ++d) out[d] = static_cast<float>(row[d]);
}

template <int D>
inline float dot(const float* q, const float* k, int dim) {
  const int n = D > 0 ? D : dim;
  float a = 0.0f;
#pragma omp simd reduction(+ : a)
  for (int d = 0; d < n; ++d) a += q[d] * k[d];
  return a;
}

template <int D>
inline void axpy(float* acc, float w, const float* v, int dim) {
  const int n = D > 0 ? D : dim;
#pragma omp simd
  for (int d = 0; d < n; ++d) acc[d] += w * v[d];
}

struct Args {
  const float* q;
  int64_t q_tok_stride, q_head_stride;
  const int8_t* k_cache;
  const int8_t* v_cache;
  float* out;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int window;
  float softcap;
};

template <int D>
void run(const Args& a, int threads) {
  const int group = a.num_heads / a.num_kv_heads;
  const int dim = a.head_dim;
  const int64_t row = dim + 2;
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
      const int len = a.seq_lens[s];
      const int lo = a.window > 0 ? std::max(0, len - a.window) : 0;
      const int n = len - lo;
      const int32_t* table = a.block_tables + static_cast<int64_t>(s) * a.bt_stride;
      for (int g = 0; g < group; ++g) {
        const float* src = a.q + s * a.q_tok_stride + static_cast<int64_t>(kvh * group + g) * a.q_head_stride;
        for (int d = 0; d < dim; ++d) qs[g * dim + d] = src[d] * a.scale;
      }
      scores.resize(static_cast<size_t>(group) * std::max(n, 1));
      std::vector<float> maxes(group, -INFINITY), sums(group, 0.0f);
      for (int i = 0; i < n; ++i) {
        const int pos = lo + i;
        const int8_t* k = a.k_cache + static_cast<int64_t>(table[pos / a.block_size]) * block_stride +
                          (pos % a.block_size) * token_stride + kvh * row;
        const float ks = row_scale(k, dim);
        widen<D>(wide.data(), k, dim);
        for (int g = 0; g < group; ++g) {
          float sc = dot<D>(&qs[g * dim], wide.data(), dim) * ks;
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
        const int pos = lo + i;
        const int8_t* v = a.v_cache + static_cast<int64_t>(table[pos / a.block_size]) * block_stride +
                          (pos % a.block_size) * token_stride + kvh * row;
        const float vs = row_scale(v, dim);
        widen<D>(wide.data(), v, dim);
        for (int g = 0; g < group; ++g) axpy<D>(&acc[g * dim], scores[g * n + i] * vs, wide.data(), dim);
      }
      for (int g = 0; g < group; ++g) {
        float* dst = a.out + (static_cast<int64_t>(s) * a.num_heads + kvh * group + g) * dim;
        const float inv = sums[g] > 0.0f ? 1.0f / sums[g] : 0.0f;
        for (int d = 0; d < dim; ++d) dst[d] = acc[g * dim + d] * inv;
      }
    }
  }
}

}  // namespace pagedkv_int8

extern "C" {

// One query token per sequence (token s is sequence s); 0 on success, nonzero for unhandled arguments.
int pagedkv_cpu_decode_int8(const float* q, int64_t q_tok_stride, int64_t q_head_stride, const int8_t* k_cache,
                            const int8_t* v_cache, float* out, const int32_t* block_tables, int64_t bt_stride,
                            const int32_t* seq_lens, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                            int block_size, float scale, int window, float softcap, int threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 || block_size <= 0) return 1;
  pagedkv_int8::Args a{q, q_tok_stride, q_head_stride, k_cache, v_cache, out, block_tables, bt_stride, seq_lens,
                       num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window, softcap};
  threads = std::max(1, threads);
  switch (head_dim) {
    case 64: pagedkv_int8::run<64>(a, threads); break;
    case 128: pagedkv_int8::run<128>(a, threads); break;
    default: pagedkv_int8::run<0>(a, threads); break;
  }
  return 0;
}

}  // extern "C"
