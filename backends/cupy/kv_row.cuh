// The KV cache row formats the attention kernels read, as a template tag.
//
// KvSame: the cache holds the model dtype DT, head_dim values per (token, KV
// head) row, 16-byte aligned. KvInt8 (--kv-cache-dtype int8, core/kv/kv_dtype.py):
// head_dim int8 values, then the row's scale. The kernels widen the int8 values
// to float in registers and apply the scale once per row (to the K row's dot
// product, to the V row's probability), so the dequantized cache never exists
// in memory. An 8-bit row is only as aligned as its byte stride, so it is read
// byte by byte; the row stride and the scale are read only through
// kv_row_bytes and kv_row_scale, the two places that know the scale's encoding.
#pragma once
#include "common.cuh"

namespace pagedkv {

// Bytes per (token, KV head) row of an 8-bit cache: the values, then a bfloat16 scale.
__device__ __forceinline__ int kv_row_bytes(int head_dim) { return head_dim + 2; }

// The scale of one 8-bit row (little-endian bfloat16 after the values; read bytewise, any alignment).
__device__ __forceinline__ float kv_row_scale(const signed char* row, int head_dim) {
    const unsigned int lo = static_cast<unsigned char>(row[head_dim]);
    const unsigned int hi = static_cast<unsigned char>(row[head_dim + 1]);
    return __uint_as_float((lo | (hi << 8)) << 16);
}

struct KvSame {};
struct KvInt8 {};

template <typename KV, typename DT>
struct KvRow;

template <typename DT>
struct KvRow<KvSame, DT> {
    typedef typename DT::storage storage;
    static __device__ __forceinline__ int stride(int head_dim) { return head_dim; }
    static __device__ __forceinline__ float scale(const storage*, int) { return 1.f; }
    // Vec<DT>::N values starting at p (16-byte aligned).
    static __device__ __forceinline__ void load(const storage* p, float* out) { unpack16<DT>(load16(p), out); }
};

template <typename DT>
struct KvRow<KvInt8, DT> {
    typedef signed char storage;
    static __device__ __forceinline__ int stride(int head_dim) { return kv_row_bytes(head_dim); }
    static __device__ __forceinline__ float scale(const storage* row, int head_dim) {
        return kv_row_scale(row, head_dim);
    }
    // Vec<DT>::N raw int8 values starting at p, unscaled.
    static __device__ __forceinline__ void load(const storage* p, float* out) {
#pragma unroll
        for (int i = 0; i < Vec<DT>::N; ++i) out[i] = static_cast<float>(p[i]);
    }
};

}  // namespace pagedkv
