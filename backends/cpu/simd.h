// The vector layer of the CPU kernel: one width per build, chosen by the -march the build gets
// (build.py compiles one library per instruction set and loads the best one the CPU runs).
//
//   AVX-512 (x86-64-v4): 16 floats a vector, 32 registers
//   AVX2+FMA (x86-64-v3): 8 floats, 16 registers
//   anything else (SSE2, NEON): 4 floats, 16 registers
//
// Everything the kernels need that depends on the width lives here: the vector types, row loads
// (load_row: one per cache element type: float, bf16, int8), the shuffle
// trees that sum or compare across lanes, the in-register transpose, and the register-tile sizes
// the decode and prefill units use. The shuffle masks are computed at compile time from the width,
// so one definition serves every build. Included through numerics.h by every kernel header.
// Design and measurements: docs/cpu_kernels.md.

#pragma once

#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>  // the int8 row widening
#endif

namespace {


// PAGEDKV_AVX512_SHAPE (a test build, build.py's "avx512-shape"): the AVX-512 build's widths and register
// tiles emitted as AVX2 instructions (GCC splits each 16-lane vector in two), so that a machine without
// AVX-512 still executes every loop bound, tile size and shuffle mask the AVX-512 build runs. Only the
// instruction selection and the int8 row widening below differ from the real AVX-512 build.
#if defined(PAGEDKV_AVX512_SHAPE)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
constexpr const char* kIsaName = "avx512-shape";
#elif defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
#if defined(__AVX512BF16__)
constexpr const char* kIsaName = "avx512-bf16";  // the avx512 build and vdpbf16ps for bf16 weights (linear.h)
#else
constexpr const char* kIsaName = "avx512";
#endif
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
#if defined(__AVXVNNI__)
constexpr const char* kIsaName = "avx2-vnni";  // the avx2 build and vpdpbusd for GGUF blocks (quant_int8.h)
#else
constexpr const char* kIsaName = "avx2";
#endif
#else
constexpr int kLanes = 4;
constexpr int kRegisters = 16;
constexpr const char* kIsaName = "generic";
#endif

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));

constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }
constexpr int kLaneBits = log2_of(kLanes);

// Register tiles. Prefill: kRowBlock query rows x kKeyVecs score vectors stay in registers, next to
// the kKeyVecs vectors of one transposed key column and a broadcast (AVX-512: 6 x 4 + 4 + 1 = 29 of 32;
// AVX2: 2 x 4 + 4 + 1 = 13 of 16). Why these sizes, and what the others measured: docs/cpu_kernels.md.
constexpr int kChunk = 4 * kLanes;  // keys per softmax chunk: 4 score vectors a row
constexpr int kKeyVecs = kChunk / kLanes;
constexpr int kRowBlock = kRegisters >= 32 ? 6 : 2;
// P.V: kRowBlock x kPvSlice accumulators and kPvSlice vectors of a V row (AVX-512: 6 x 4 + 4; AVX2: 2 x 4 + 4).
constexpr int kPvSlice = 4;
// Decode: query heads per pass such that their queries fill at most half the registers.
constexpr int decode_max_pass(int dt) {
  return dt * 2 <= kRegisters / 2 * kLanes ? (dt * 4 <= kRegisters / 2 * kLanes ? 4 : 2) : 1;
}

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

// x - 0 is x for every x (0 + x is not, for x = -0), so this folds to a plain broadcast: no vaddss.
inline vfloat splat(float x) { return x - vfloat{}; }

inline vint lane_index() {
  vint v;
  for (int l = 0; l < kLanes; ++l) v[l] = l;
  return v;
}

// kLanes consecutive elements of a cache row as floats (bf16 widened in registers).
template <typename T>
inline vfloat load_row(const T* p);
template <>
inline vfloat load_row<float>(const float* p) {
  return load(p);
}
template <>
inline vfloat load_row<uint16_t>(const uint16_t* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof(h));
  const vuint wide = __builtin_convertvector(h, vuint) << 16;
  vfloat f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// kLanes int8 values widened to float in registers (the int8 cache, decode_int8.h): one sign-extending load
// and one int->float conversion a vector on AVX2 / AVX-512, lane by lane elsewhere.
template <>
inline vfloat load_row<int8_t>(const int8_t* p) {
#if defined(__AVX512F__) && !defined(PAGEDKV_AVX512_SHAPE)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
#elif defined(__AVX2__) && !defined(PAGEDKV_AVX512_SHAPE)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<vfloat>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
#else
  vfloat f;
  for (int l = 0; l < kLanes; ++l) f[l] = static_cast<float>(p[l]);
  return f;
#endif
}

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// --- shuffle trees --------------------------------------------------------------------------------
// tree_level<H>(a, b): adds the lanes of each vector H apart (pairs of H-lane blocks) and interleaves
// the two results in H-lane blocks: a's first block, b's first, a's second... Applied log2(kLanes)
// times with H = kLanes / 2, ..., 1 it sums kLanes vectors into one vector of their kLanes sums,
// input i landing in lane tree_lane(i) (the bit reversal of i).
constexpr int tree_lo(int h, int o) { return ((o / h) % 2 ? kLanes : 0) + (o / h / 2) * 2 * h + o % h; }

template <int H, int... I>
inline vfloat tree_level_(vfloat a, vfloat b, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(a, b, tree_lo(H, I)...) + __builtin_shufflevector(a, b, (tree_lo(H, I) + H)...);
}
template <int H>
inline vfloat tree_level(vfloat a, vfloat b) {
  return tree_level_<H>(a, b, std::make_integer_sequence<int, kLanes>{});
}

constexpr int tree_lane(int i) {
  int r = 0;
  for (int b = 0; b < kLaneBits; ++b) r |= ((i >> b) & 1) << (kLaneBits - 1 - b);
  return r;
}

// One vector of the kLanes lane sums of v[0..kLanes): lane l holds the sum of v[tree_lane(l)].
template <int Depth = kLaneBits>
inline vfloat sum_lanes_tree(const vfloat* v) {
  if constexpr (Depth == 0) {
    return v[0];
  } else {
    constexpr int half = 1 << (Depth - 1);
    return tree_level<(kLanes >> Depth)>(sum_lanes_tree<Depth - 1>(v), sum_lanes_tree<Depth - 1>(v + half));
  }
}

// Lanes reduced by a tree of shuffles (GCC turns the plain loop into a serial chain of scalar ops).
template <int H, int... I>
inline vfloat rotate_(vfloat v, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(v, v, ((I + H) % kLanes)...);
}
template <int H = kLanes / 2>
inline float max_lanes(vfloat v) {
  if constexpr (H == 0) {
    return v[0];
  } else {
    return max_lanes<H / 2>(vmax(v, rotate_<H>(v, std::make_integer_sequence<int, kLanes>{})));
  }
}
template <int H = kLanes / 2>
inline float add_lanes(vfloat v) {
  if constexpr (H == 0) {
    return v[0];
  } else {
    return add_lanes<H / 2>(v + rotate_<H>(v, std::make_integer_sequence<int, kLanes>{}));
  }
}

// --- transpose --------------------------------------------------------------------------------------
// kLanes x kLanes in registers: afterwards lane i of r[l] is what lane l of r[i] was. log2(kLanes) rounds;
// round S swaps the off-diagonal S x S sub-blocks of every 2S x 2S block, two-source shuffles of row
// pairs S apart (AVX-512: 64 shuffles for 256 elements; AVX2: 24 for 64).
constexpr int swap_lo(int s, int l) { return (l & s) == 0 ? l : kLanes + l - s; }
constexpr int swap_hi(int s, int l) { return (l & s) == 0 ? l + s : kLanes + l; }

template <int S, int... I>
inline void transpose_round(vfloat* r, std::integer_sequence<int, I...>) {
  for (int i = 0; i < kLanes; ++i) {
    if (i & S) continue;
    const vfloat a = r[i], b = r[i + S];
    r[i] = __builtin_shufflevector(a, b, swap_lo(S, I)...);
    r[i + S] = __builtin_shufflevector(a, b, swap_hi(S, I)...);
  }
}

template <int S = 1>
inline void transpose_lanes(vfloat* r) {
  if constexpr (S < kLanes) {
    transpose_round<S>(r, std::make_integer_sequence<int, kLanes>{});
    transpose_lanes<S * 2>(r);
  }
}

}  // namespace
