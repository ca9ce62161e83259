// KV-cache maintenance kernels: write_kv (reshape-and-cache) and copy_blocks.
#include "common.cuh"
#include "kv_row.cuh"

// Scatter each token's K/V rows [num_kv_heads, head_dim] into cache slot
// slot_mapping[t] (= block * block_size + offset); slot -1 is skipped.
// key/value may be strided over tokens and heads; their last dim is contiguous.
// Grid (num_tokens), 128 threads.
template <typename DT>
__global__ void __launch_bounds__(128) pagedkv_write_kv(
    const typename DT::storage* __restrict__ key, const typename DT::storage* __restrict__ value,
    typename DT::storage* __restrict__ k_cache, typename DT::storage* __restrict__ v_cache,
    const long long* __restrict__ slot_mapping, int num_kv_heads, int head_dim, long long key_stride_t,
    long long key_stride_h, long long value_stride_t, long long value_stride_h) {
    using pagedkv::i64;
    const int t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0) return;
    const int row = num_kv_heads * head_dim;
    const i64 dst = slot * row;
    for (int e = threadIdx.x; e < row; e += blockDim.x) {
        const int h = e / head_dim;
        const int d = e % head_dim;
        k_cache[dst + e] = key[t * key_stride_t + h * key_stride_h + d];
        v_cache[dst + e] = value[t * value_stride_t + h * value_stride_h + d];
    }
}

// For every cache (the K and V tensor of every layer, given by address) copy
// block pairs[i, 0] onto block pairs[i, 1]. A block is words_per_block WORDs.
// Grid (num_pairs, num_caches), 256 threads.
template <typename WORD>
__global__ void __launch_bounds__(256) pagedkv_copy_blocks(
    const unsigned long long* __restrict__ cache_ptrs, const long long* __restrict__ pairs,
    long long words_per_block) {
    using pagedkv::i64;
    WORD* cache = reinterpret_cast<WORD*>(cache_ptrs[blockIdx.y]);
    const i64 src = pairs[2 * static_cast<i64>(blockIdx.x)] * words_per_block;
    const i64 dst = pairs[2 * static_cast<i64>(blockIdx.x) + 1] * words_per_block;
    for (i64 w = threadIdx.x; w < words_per_block; w += blockDim.x) cache[dst + w] = cache[src + w];
}

// write_kv into an int8 cache (--kv-cache-dtype int8): each (token, KV head) row becomes head_dim int8
// values and, in the byte after them, its E5M3 scale code (core/kv/kv_dtype.py; made, decoded and stored by
// kv_row.cuh), bit for bit as the torch reference: q = rint(x / scale) clamped to +-127 (0 and code 0 for a
// zero row). Rows are head_dim + 1 bytes, so stores are bytewise: one thread per row, which is plenty for
// the few rows a step writes. Grid (num_tokens), 128 threads.
template <typename DT>
__global__ void __launch_bounds__(128) pagedkv_write_kv_int8(
    const typename DT::storage* __restrict__ key, const typename DT::storage* __restrict__ value,
    signed char* __restrict__ k_cache, signed char* __restrict__ v_cache, const long long* __restrict__ slot_mapping,
    int num_kv_heads, int head_dim, long long key_stride_t, long long key_stride_h, long long value_stride_t,
    long long value_stride_h) {
    using pagedkv::i64;
    const int t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0) return;
    const int row = pagedkv::kv_row_bytes(head_dim);
    for (int r = threadIdx.x; r < 2 * num_kv_heads; r += blockDim.x) {
        const int h = r % num_kv_heads;
        const bool is_v = r >= num_kv_heads;
        const typename DT::storage* src = is_v ? value + t * value_stride_t + h * value_stride_h
                                               : key + t * key_stride_t + h * key_stride_h;
        signed char* dst = (is_v ? v_cache : k_cache) + (slot * num_kv_heads + h) * row;
        unsigned int amax_key = 0u;  // integers only: see kv_magnitude_key
        for (int d = 0; d < head_dim; ++d) {
            const unsigned int key_d = pagedkv::kv_magnitude_key(DT::to_float(src[d]));
            amax_key = key_d > amax_key ? key_d : amax_key;
        }
        const unsigned int code = pagedkv::kv_make_scale(amax_key >> 1, 127.0f);
        const float scale = pagedkv::kv_scale_value(code);
        const float divisor = scale > 0.0f ? scale : 1.0f;  // a zero or NaN scale divides by 1
        for (int d = 0; d < head_dim; ++d) {
            const float y = fminf(fmaxf(DT::to_float(src[d]) / divisor, -127.0f), 127.0f);
            dst[d] = static_cast<signed char>(rintf(y));
        }
        pagedkv::kv_store_scale(dst, head_dim, code);
    }
}
