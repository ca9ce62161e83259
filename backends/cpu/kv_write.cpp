// The KV write entry point: a step's new K/V rows scattered into their paged cache slots (fp32 or bf16 caches;
// the int8 cache is written by torch, core/kv/kv_dtype.py). One translation unit of the CPU kernel library.

#include <cstdint>
#include <cstring>

extern "C" {

// Scatters the new K and V rows of a step into their cache slots (a slot < 0 is skipped). A row is one token's
// heads x head_dim elements, contiguous; tokens are k_stride / v_stride elements apart. dtype 0: fp32, 1: bf16.
// Returns 0, or nonzero (nothing written) for a slot past the cache's num_slots.
int pagedkv_cpu_write_kv(int dtype, const void* k, int64_t k_stride, const void* v, int64_t v_stride, void* k_cache,
                         void* v_cache, const int64_t* slots, int64_t tokens, int64_t row, int64_t num_slots) {
  if ((dtype != 0 && dtype != 1) || tokens < 0 || row <= 0) return 1;
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] >= num_slots) return 2;  // (nothing written: the caller's reference path raises the error)
  const int64_t size = dtype == 0 ? 4 : 2;
  const char* ks = static_cast<const char*>(k);
  const char* vs = static_cast<const char*>(v);
  char* kc = static_cast<char*>(k_cache);
  char* vc = static_cast<char*>(v_cache);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;
    std::memcpy(kc + slots[t] * row * size, ks + t * k_stride * size, row * size);
    std::memcpy(vc + slots[t] * row * size, vs + t * v_stride * size, row * size);
  }
  return 0;
}

}  // extern "C"
