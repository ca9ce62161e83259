// The linear entry points: the packed fp32 and bf16-weight linears (linear.h) and, from quant_linear.h, the
// GGUF-block linear and its fused layer calls. One translation unit of the CPU kernel library.

#include "linear.h"
#include "quant_linear.h"

extern "C" {

// The packed fp32 linear (linear.h): the panel width its packed weights have, and y[rows, n] = x[rows, k]
// W^T + bias (bias may be null). Returns 0, or nonzero for sizes it does not take.
int pagedkv_cpu_linear_panel() { return kNr; }
int pagedkv_cpu_linear(const float* x, int64_t rows, int64_t k, const float* packed, const float* bias, int64_t n,
                       float* y, int threads) {
  if (rows < 0 || k <= 0 || n <= 0 || k > INT32_MAX / kNr || n > INT32_MAX) return 1;
  linear_rows_all(x, k, rows, static_cast<int>(k), packed, bias, static_cast<int>(n), y, false,
                  std::max(1, threads));
  return 0;
}

// The packed linear on bf16 weights (linear.h's bf16 panels, [panel][k / 2][panel width][2], K padded to even):
// y[rows, n] = x[rows, k] W^T + bias in fp32, x and bias fp32. Returns 0, or nonzero for sizes it does not take.
int pagedkv_cpu_linear_bf16(const float* x, int64_t rows, int64_t k, const uint16_t* packed, const float* bias,
                            int64_t n, float* y, int threads) {
  if (rows < 0 || k <= 0 || n <= 0 || k > INT32_MAX / kNr || n > INT32_MAX) return 1;
  std::vector<Bf16Weights::X> buf;
  linear_from_f32<Bf16Weights>(x, k, rows, k, packed, bias, static_cast<int>(n), y, false, std::max(1, threads), buf);
  return 0;
}
// How this build multiplies bf16 weights: "avx512-bf16 vdpbf16ps" or "widened in registers".
const char* pagedkv_cpu_linear_bf16_path() { return kBf16Path; }

}  // extern "C"
