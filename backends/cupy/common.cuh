// Shared device helpers for the pagedkv CUDA kernels.
//
// The sources are compiled by NVRTC (through CuPy at run time, directly in CI)
// without any CUDA header: neither cuda_fp16.h nor cuda_bf16.h is available to
// NVRTC here, and CuPy has no bfloat16 dtype anyway. 16-bit values therefore
// travel as raw `unsigned short` bits and are converted with PTX `cvt`
// instructions (fp16) or bit shifts (bf16). Every kernel is templated on one of
// the dtype tags below.
#pragma once

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace pagedkv {

typedef long long i64;

// ---------------------------------------------------------------- dtype tags

struct F32 {
    typedef float storage;
    static __device__ __forceinline__ float to_float(float x) { return x; }
    static __device__ __forceinline__ float from_float(float x) { return x; }
};

struct F16 {
    typedef unsigned short storage;
    static __device__ __forceinline__ float to_float(unsigned short bits) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
        return f;
    }
    static __device__ __forceinline__ unsigned short from_float(float f) {
        unsigned short bits;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f));
        return bits;
    }
};

struct BF16 {
    typedef unsigned short storage;
    static __device__ __forceinline__ float to_float(unsigned short bits) {
        return __uint_as_float(static_cast<unsigned int>(bits) << 16);
    }
    static __device__ __forceinline__ unsigned short from_float(float f) {
#if __CUDA_ARCH__ >= 800
        unsigned short bits;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(f));
        return bits;
#else
        // Round to nearest even, canonical quiet NaN (what torch does).
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned short>(((u >> 16) & 0x8000u) | 0x7fc0u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return static_cast<unsigned short>(u >> 16);
#endif
    }
};

// Elements of one 16-byte vector.
template <typename DT>
struct Vec {
    static constexpr int N = 16 / sizeof(typename DT::storage);
};

// Unpack one 16-byte vector (uint4) into Vec<DT>::N floats.
template <typename DT>
__device__ __forceinline__ void unpack16(const uint4& v, float* out) {
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
    if (sizeof(typename DT::storage) == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[2 * i] = DT::to_float(static_cast<typename DT::storage>(w[i] & 0xffffu));
            out[2 * i + 1] = DT::to_float(static_cast<typename DT::storage>(w[i] >> 16));
        }
    }
}

// Pack Vec<DT>::N floats into one 16-byte vector of DT.
template <typename DT>
__device__ __forceinline__ uint4 pack16(const float* in) {
    unsigned int w[4];
    if (sizeof(typename DT::storage) == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = __float_as_uint(in[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int lo = static_cast<unsigned int>(DT::from_float(in[2 * i]));
            const unsigned int hi = static_cast<unsigned int>(DT::from_float(in[2 * i + 1]));
            w[i] = lo | (hi << 16);
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }

__device__ __forceinline__ void store16(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

// ------------------------------------------------------------ compile-time math

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

__host__ __device__ constexpr int next_pow2(int x) { return x <= 1 ? 1 : 2 * next_pow2((x + 1) / 2); }

__host__ __device__ constexpr int min_int(int a, int b) { return a < b ? a : b; }

// --------------------------------------------------------------- warp reductions
// All 32 lanes must call these (full mask); `width` is a power of two <= 32 and the
// reduction happens inside each aligned group of `width` lanes.

__device__ __forceinline__ float group_sum(float x, int width) {
    for (int o = width / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o, width);
    return x;
}

__device__ __forceinline__ float group_max(float x, int width) {
    for (int o = width / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o, width));
    return x;
}

// Physical block id -> first element of (block, offset, kv_head) in a
// [num_blocks, block_size, num_kv_heads, row] cache (row: elements per row); 64-bit arithmetic.
__device__ __forceinline__ i64 cache_offset(int block, int block_size, int offset, int num_kv_heads, int kv_head,
                                            int row) {
    return ((static_cast<i64>(block) * block_size + offset) * num_kv_heads + kv_head) * static_cast<i64>(row);
}

}  // namespace pagedkv
