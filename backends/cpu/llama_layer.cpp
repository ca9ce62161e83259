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
  return llama_attention_inputs<F32Weights, float>(h, rows, d, norm_weight, eps, wqkv, nq, nkv, head_dim, cos, sin, xn,
                                                   QkvSink<float>{qkv}, threads);
}
// The same on bf16 weights (linear.h's bf16 panels); activations, norm weights, cos/sin and outputs stay fp32.
int pagedkv_cpu_llama_attention_inputs_bf16(const float* h, int64_t rows, int64_t d, const float* norm_weight,
                                            float eps, const uint16_t* wqkv, int64_t nq, int64_t nkv,
                                            int64_t head_dim, const float* cos, const float* sin, float* xn,
                                            float* qkv, int threads) {
  return llama_attention_inputs<Bf16Weights, float>(h, rows, d, norm_weight, eps, wqkv, nq, nkv, head_dim, cos, sin,
                                                    xn, QkvSink<float>{qkv}, threads);
}

// MLP block: h [rows, d] += attn [rows, nq] Wo^T; xn = RMSNorm(h); gu = xn [Wg; Wu]^T [rows, 2 inter];
// h += (SiLU(gate) * up) Wd^T. h is updated in place; xn [min(rows, kRowChunk), d] and gu [min(rows,
// kRowChunk), 2 inter] are scratch.
int pagedkv_cpu_llama_mlp(float* h, int64_t rows, int64_t d, const float* attn, int64_t nq, const float* wo,
                          const float* norm_weight, float eps, const float* wgu, int64_t inter, const float* wdown,
                          float* xn, float* gu, int threads) {
  return llama_mlp<F32Weights, float>(h, rows, d, attn, nq, wo, norm_weight, eps, wgu, inter, wdown, xn, gu, nullptr,
                                      threads);
}
// The same on bf16 weights; h, attn, the norm weight and the scratch stay fp32.
int pagedkv_cpu_llama_mlp_bf16(float* h, int64_t rows, int64_t d, const float* attn, int64_t nq, const uint16_t* wo,
                               const float* norm_weight, float eps, const uint16_t* wgu, int64_t inter,
                               const uint16_t* wdown, float* xn, float* gu, int threads) {
  return llama_mlp<Bf16Weights, float>(h, rows, d, attn, nq, wo, norm_weight, eps, wgu, inter, wdown, xn, gu,
                                       nullptr, threads);
}

// The layer's calls on activations of the weights' dtype (fp32 here, bf16 below), no torch conversion around
// them: attention inputs into out [rows, nq + 2 nkv], or, with k_cache, q into out [rows, nq] and the rotated k and
// the v rows straight into their slots of the paged cache (slot < 0 skipped; one past num_slots: nothing written,
// 2 returned); scratch is pagedkv_cpu_llama_attention_scratch floats per row of min(rows, scratch rows).
int pagedkv_cpu_llama_attention_kv(const float* h, int64_t rows, int64_t d, const float* norm_weight, float eps,
                                   const float* wqkv, int64_t nq, int64_t nkv, int64_t head_dim, const float* cos,
                                   const float* sin, float* scratch, float* out, float* k_cache, float* v_cache,
                                   const int64_t* slots, int64_t num_slots, int threads) {
  return llama_attention_inputs<F32Weights, float>(h, rows, d, norm_weight, eps, wqkv, nq, nkv, head_dim, cos, sin,
                                                   scratch, {out, k_cache, v_cache, slots, num_slots}, threads);
}
int pagedkv_cpu_llama_attention_kv_bf16(const uint16_t* h, int64_t rows, int64_t d, const float* norm_weight,
                                        float eps, const uint16_t* wqkv, int64_t nq, int64_t nkv, int64_t head_dim,
                                        const uint16_t* cos, const uint16_t* sin, float* scratch, uint16_t* out,
                                        uint16_t* k_cache, uint16_t* v_cache, const int64_t* slots, int64_t num_slots,
                                        int threads) {
  return llama_attention_inputs<Bf16Weights, uint16_t>(h, rows, d, norm_weight, eps, wqkv, nq, nkv, head_dim, cos,
                                                       sin, scratch, {out, k_cache, v_cache, slots, num_slots},
                                                       threads);
}
int64_t pagedkv_cpu_llama_attention_scratch(int64_t d, int64_t width, int64_t head_dim) {
  return attention_scratch_floats(d, width, head_dim);
}
// The MLP block on bf16 activations: h and attn bf16; xn, gu as above and wide [min(rows, scratch rows), d + nq]
// fp32 scratch.
int pagedkv_cpu_llama_mlp_bf16_act(uint16_t* h, int64_t rows, int64_t d, const uint16_t* attn, int64_t nq,
                                   const uint16_t* wo, const float* norm_weight, float eps, const uint16_t* wgu,
                                   int64_t inter, const uint16_t* wdown, float* xn, float* gu, float* wide,
                                   int threads) {
  return llama_mlp<Bf16Weights, uint16_t>(h, rows, d, attn, nq, wo, norm_weight, eps, wgu, inter, wdown, xn, gu, wide,
                                          threads);
}

// Rows of the layer calls' scratch (xn, gu): they go through kRowChunk rows at a time.
int pagedkv_cpu_llama_scratch_rows() { return kRowChunk; }

}  // extern "C"
