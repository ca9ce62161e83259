// The fused Llama layer entry points (llama_block.h): attention inputs and MLP block on fp32 or bf16 weights.
// One translation unit of the CPU kernel library.

#include "llama_block.h"

extern "C" {

// A Llama layer's dense parts (llama_block.h). attention inputs: h [rows, d] -> qkv [rows, nq + 2 nkv] (q and k
// rotated by cos/sin [rows, head_dim]), through the scratch xn [min(rows, kRowChunk), d]; wqkv is [Wq; Wk; Wv]
// packed.
int pagedkv_cpu_llama_attention_inputs(const float* h, int64_t rows, int64_t d, const float* norm_weight, float eps,
                                       const float* wqkv, int64_t nq, int64_t nkv, int64_t head_dim,
                                       const float* cos, const float* sin, float* xn, float* qkv, int threads) {
  return llama_attention_inputs<F32Weights>(h, rows, d, norm_weight, eps, wqkv, nq, nkv, head_dim, cos, sin, xn, qkv,
                                            threads);
}
// The same on bf16 weights (linear.h's bf16 panels); activations, norm weights, cos/sin and outputs stay fp32.
int pagedkv_cpu_llama_attention_inputs_bf16(const float* h, int64_t rows, int64_t d, const float* norm_weight,
                                            float eps, const uint16_t* wqkv, int64_t nq, int64_t nkv,
                                            int64_t head_dim, const float* cos, const float* sin, float* xn,
                                            float* qkv, int threads) {
  return llama_attention_inputs<Bf16Weights>(h, rows, d, norm_weight, eps, wqkv, nq, nkv, head_dim, cos, sin, xn,
                                             qkv, threads);
}

// MLP block: h [rows, d] += attn [rows, nq] Wo^T; xn = RMSNorm(h); gu = xn [Wg; Wu]^T [rows, 2 inter];
// h += (SiLU(gate) * up) Wd^T. h is updated in place; xn [min(rows, kRowChunk), d] and gu [min(rows,
// kRowChunk), 2 inter] are scratch.
int pagedkv_cpu_llama_mlp(float* h, int64_t rows, int64_t d, const float* attn, int64_t nq, const float* wo,
                          const float* norm_weight, float eps, const float* wgu, int64_t inter, const float* wdown,
                          float* xn, float* gu, int threads) {
  return llama_mlp<F32Weights>(h, rows, d, attn, nq, wo, norm_weight, eps, wgu, inter, wdown, xn, gu, threads);
}
// The same on bf16 weights; h, attn, the norm weight and the scratch stay fp32.
int pagedkv_cpu_llama_mlp_bf16(float* h, int64_t rows, int64_t d, const float* attn, int64_t nq, const uint16_t* wo,
                               const float* norm_weight, float eps, const uint16_t* wgu, int64_t inter,
                               const uint16_t* wdown, float* xn, float* gu, int threads) {
  return llama_mlp<Bf16Weights>(h, rows, d, attn, nq, wo, norm_weight, eps, wgu, inter, wdown, xn, gu, threads);
}

// Rows of the layer calls' scratch (xn, gu): they go through kRowChunk rows at a time.
int pagedkv_cpu_llama_scratch_rows() { return kRowChunk; }

}  // extern "C"
