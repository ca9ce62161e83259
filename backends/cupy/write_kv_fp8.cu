// write_kv into an fp8 cache (--kv-cache-dtype fp8_e4m3 | fp8_e5m2), bit for bit as quantize_rows in
// core/kv/kv_dtype.py: the row's scale as for int8, then fp8(clamp(x / scale, +-QMAX)) rounded to nearest
// even straight from float32 (through fp16 it would round twice). One thread per (token, KV head) row, as
// pagedkv_write_kv_int8. Grid (num_tokens), 128 threads.
#include "common.cuh"
#include "kv_row.cuh"

namespace pagedkv {

// float32 -> fp8 with MAN mantissa bits and exponent bias BIAS, round to nearest even; |y| must not exceed
// the largest finite fp8 (the caller clamps). A subnormal is rint(|y| / its step), whose bits are the code
// itself (a carry into 2^(1-BIAS) gives the smallest normal's code); a normal rounds off 23 - MAN bits.
template <int MAN, int BIAS>
__device__ __forceinline__ unsigned char fp8_from_float(float y) {
    const unsigned int sign = (__float_as_uint(y) >> 24) & 0x80u;
    const unsigned int u = __float_as_uint(y) & 0x7fffffffu;
    const float min_normal = __uint_as_float(static_cast<unsigned int>(128 - BIAS) << 23);      // 2^(1-BIAS)
    const float inv_step = __uint_as_float(static_cast<unsigned int>(126 + BIAS + MAN) << 23);  // 2^(BIAS-1+MAN)
    unsigned int bits;
    if (__uint_as_float(u) < min_normal) {
        bits = static_cast<unsigned int>(rintf(__uint_as_float(u) * inv_step));
    } else {
        const unsigned int r = u + (1u << (22 - MAN)) - 1u + ((u >> (23 - MAN)) & 1u);
        bits = (((r >> 23) - 127u + BIAS) << MAN) | ((r >> (23 - MAN)) & ((1u << MAN) - 1u));
    }
    return static_cast<unsigned char>(sign | bits);
}

}  // namespace pagedkv

template <typename DT, bool E4M3>
__global__ void __launch_bounds__(128) pagedkv_write_kv_fp8(
    const typename DT::storage* __restrict__ key, const typename DT::storage* __restrict__ value,
    unsigned char* __restrict__ k_cache, unsigned char* __restrict__ v_cache,
    const long long* __restrict__ slot_mapping, int num_kv_heads, int head_dim, long long key_stride_t,
    long long key_stride_h, long long value_stride_t, long long value_stride_h) {
    using namespace pagedkv;
    const int t = blockIdx.x;
    const i64 slot = slot_mapping[t];
    if (slot < 0) return;
    const float qmax = E4M3 ? 448.0f : 57344.0f;
    const int row = kv_row_bytes(head_dim);
    for (int r = threadIdx.x; r < 2 * num_kv_heads; r += blockDim.x) {
        const int h = r % num_kv_heads;
        const bool is_v = r >= num_kv_heads;
        const typename DT::storage* src = is_v ? value + t * value_stride_t + h * value_stride_h
                                               : key + t * key_stride_t + h * key_stride_h;
        unsigned char* dst = (is_v ? v_cache : k_cache) + (slot * num_kv_heads + h) * row;
        unsigned int amax_key = 0u;  // integers only: see kv_magnitude_key
        for (int d = 0; d < head_dim; ++d) {
            const unsigned int key_d = kv_magnitude_key(DT::to_float(src[d]));
            amax_key = key_d > amax_key ? key_d : amax_key;
        }
        const unsigned int code = kv_make_scale(amax_key >> 1, qmax);
        const float scale = kv_scale_value(code);
        const float divisor = scale > 0.0f ? scale : 1.0f;  // a zero or NaN scale divides by 1
        for (int d = 0; d < head_dim; ++d) {
            const float y = fminf(fmaxf(DT::to_float(src[d]) / divisor, -qmax), qmax);
            dst[d] = E4M3 ? fp8_from_float<3, 7>(y) : fp8_from_float<2, 15>(y);
        }
        kv_store_scale(reinterpret_cast<signed char*>(dst), head_dim, code);
    }
}
