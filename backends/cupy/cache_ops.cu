// KV-cache maintenance kernels: write_kv (reshape-and-cache) and copy_blocks.
#include "common.cuh"

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
