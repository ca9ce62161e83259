// The KV cache row formats the attention kernels read, as a template tag.
//
// KvSame: the cache holds the model dtype DT, head_dim values per (token, KV
// head) row, 16-byte aligned. KvInt8 (--kv-cache-dtype int8, core/kv/kv_dtype.py):
// head_dim int8 values, then the row's scale (KvE4M3 / KvE5M2: fp8 values, the
// same scale). The kernels widen the 8-bit values to float in registers and
// apply the scale once per row (to the K row's dot product, to the V row's
// probability), so the dequantized cache never exists in memory. An 8-bit row is only as aligned as its byte stride, so it is read
// byte by byte; the row stride and the scale are read only through
// kv_row_bytes and kv_row_scale (and made and written only through
// kv_make_scale and kv_store_scale), the places that know the scale's encoding.
#pragma once
#include "common.cuh"

namespace pagedkv {

// Bytes per (token, KV head) row of an 8-bit cache: the values, then a 1-byte E5M3 scale code.
__device__ __forceinline__ int kv_row_bytes(int head_dim) { return head_dim + 1; }

// An E5M3 scale code as its float32 scale, exactly (core/kv/kv_dtype.py, SCALE_BIAS 22): the bits are
// (code << 20) + ((127 - 22) << 23); code 0 is a zero row's scale, code 255 a non-finite row's (NaN).
__device__ __forceinline__ float kv_scale_value(unsigned int code) {
    return __uint_as_float(code == 0u ? 0u : code == 255u ? 0x7fc00000u : (code << 20) + (105u << 23));
}

// The scale of one 8-bit row (the byte after the values).
__device__ __forceinline__ float kv_row_scale(const signed char* row, int head_dim) {
    return kv_scale_value(static_cast<unsigned char>(row[head_dim]));
}

// fp8 bytes as float, exactly. e5m2 is the high byte of an fp16; e4m3 (no infinities, S.1111.111 is NaN)
// is rebuilt bit by bit: a normal's exponent rebiased from 7 to 127, a subnormal as mantissa * 2^-9.
__device__ __forceinline__ float fp8_e5m2_to_float(unsigned char b) {
    return F16::to_float(static_cast<unsigned short>(static_cast<unsigned short>(b) << 8));
}

__device__ __forceinline__ float fp8_e4m3_to_float(unsigned char b) {
    const unsigned int sign = static_cast<unsigned int>(b & 0x80u) << 24;
    const unsigned int exp = (b >> 3) & 0xfu;
    const unsigned int man = b & 0x7u;
    if (exp == 0xfu && man == 0x7u) return __uint_as_float(sign | 0x7fc00000u);
    if (exp == 0u) return __uint_as_float(sign | __float_as_uint(static_cast<float>(man) * 0.001953125f));
    return __uint_as_float(sign | ((exp + 120u) << 23) | (man << 20));
}

// |x| as an unsigned key: its float32 bits shifted past the sign. Keys order magnitudes by value (a NaN's
// above infinity's, so a NaN row's amax is NaN, as torch's amax), and key >> 1 is |x|'s bits. No float
// instruction may touch a row's amax: CuPy always compiles with -ftz=true, and then fabsf, fmaxf, division
// and == all read a subnormal operand as 0, so a row of fp32 or bf16 subnormals would get code 0 where the
// reference (IEEE, subnormals kept) gives code 1. (Not bits & 0x7fffffff: LLVM may rewrite that as fabs.)
__device__ __forceinline__ unsigned int kv_magnitude_key(float x) { return __float_as_uint(x) << 1; }

// The scale code of a row whose largest magnitude has the float32 bits amax_bits (its largest
// kv_magnitude_key >> 1), for an 8-bit format whose largest value is qmax: float32(amax / qmax), IEEE-rounded,
// rounded up to 3 mantissa bits and rebiased, clamped to [1, 254]; 0 when that quotient is 0, 255 for a
// non-finite row. Decode it with kv_scale_value. Exact under -ftz=true: a subnormal amax (m * 2^-149, m its
// bits) is decided on its bits, as IEEE rounds m * 2^-149 / qmax to 0 exactly when m <= qmax / 2 (a tie, at
// an even qmax, goes to the even 0) and otherwise to a subnormal, whose code is 1; a normal amax's quotient
// is IEEE-rounded (-prec-div, NVRTC's default), and one below 2^-126 that flushes to 0 still gets code 1, as
// every quotient up to 2^-22 does.
__device__ __forceinline__ unsigned int kv_make_scale(unsigned int amax_bits, float qmax) {
    if (amax_bits >= 0x7f800000u) return 255u;
    if (amax_bits < 0x00800000u) return amax_bits <= static_cast<unsigned int>(qmax * 0.5f) ? 0u : 1u;
    const unsigned int bits = __float_as_uint(__uint_as_float(amax_bits) / qmax);
    const int code = static_cast<int>((bits + 0xfffffu) >> 20) - (105 << 3);
    return static_cast<unsigned int>(code < 1 ? 1 : code > 254 ? 254 : code);
}

// Store a code made by kv_make_scale after the row's head_dim values.
__device__ __forceinline__ void kv_store_scale(signed char* row, int head_dim, unsigned int code) {
    row[head_dim] = static_cast<signed char>(static_cast<unsigned char>(code));
}

struct KvSame {};
struct KvInt8 {};
struct KvE4M3 {};
struct KvE5M2 {};

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

// fp8 rows: the same layout and scale as int8, each value one fp8 byte.
template <typename DT, bool E4M3>
struct KvFp8Row {
    typedef unsigned char storage;
    static __device__ __forceinline__ int stride(int head_dim) { return kv_row_bytes(head_dim); }
    static __device__ __forceinline__ float scale(const storage* row, int head_dim) {
        return kv_row_scale(reinterpret_cast<const signed char*>(row), head_dim);
    }
    static __device__ __forceinline__ void load(const storage* p, float* out) {
#pragma unroll
        for (int i = 0; i < Vec<DT>::N; ++i) out[i] = E4M3 ? fp8_e4m3_to_float(p[i]) : fp8_e5m2_to_float(p[i]);
    }
};

template <typename DT>
struct KvRow<KvE4M3, DT> : KvFp8Row<DT, true> {};

template <typename DT>
struct KvRow<KvE5M2, DT> : KvFp8Row<DT, false> {};

}  // namespace pagedkv
