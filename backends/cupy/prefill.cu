// Paged prefill attention with cached context (chunked prefill).
//
// Query row j of sequence s sits at absolute position context_lens[s] + j and
// attends to keys at positions <= context_lens[s] + j (causal, aligned
// bottom-right); the keys (cached context and this step's rows, written by
// write_kv before the call) all come from the paged cache.
//
// Grid (num_seqs, num_kv_heads, item_tiles), 128 threads. The "items" of a
// sequence are its (query row, query head) pairs for one KV head, row-major, so
// a tile of QM items covers QM / group_size rows and all of the heads sharing
// that KV head: each K/V tile loaded into shared memory serves all of them.
// Flash-style online softmax in fp32 on CUDA cores. Keys at or past the tile's
// last needed position are never loaded (their shared rows are zero-filled), so
// unused cache slots cannot leak into the output.
#include "common.cuh"
#include "kv_row.cuh"

namespace pagedkv {

constexpr int PREFILL_THREADS = 128;

template <typename DT, int HEAD_DIM>
struct PrefillShape {
    static constexpr int VEC = Vec<DT>::N;
    static constexpr int ROW_VECS = HEAD_DIM / VEC;
    static constexpr int QM = HEAD_DIM <= 128 ? 32 : 16;  // items per tile
    static constexpr int BN = HEAD_DIM <= 128 ? 32 : 16;  // keys per tile
    static constexpr int TPI = PREFILL_THREADS / QM;      // threads per item
    static constexpr int KPT = BN / TPI;                   // keys per thread
    static constexpr int DPT = HEAD_DIM / TPI;             // output dims per thread
    static constexpr int LD = HEAD_DIM + 1;                // padded shared row (bank conflicts)
    static constexpr int LDP = BN + 1;
    static_assert(HEAD_DIM % VEC == 0, "head_dim * sizeof(dtype) must be a multiple of 16 bytes");
    static_assert(HEAD_DIM % TPI == 0, "head_dim must be a multiple of the threads per item");
    static constexpr int SMEM_FLOATS = QM * LD + BN * LD + QM * LDP;
};

}  // namespace pagedkv

// Static shared memory only (at most QM*LD + BN*LD + QM*LDP floats, < 48 KiB for head_dim <= 256).
// Sequences with fewer than min_query_len query rows are left to the decode kernel.
// KV: the cache's row format (kv_row.cuh); an 8-bit row is scaled as it enters shared memory.
template <typename DT, int HEAD_DIM, int BLOCK_SIZE, typename KV = pagedkv::KvSame>
__global__ void __launch_bounds__(pagedkv::PREFILL_THREADS) pagedkv_prefill(
    typename DT::storage* __restrict__ out,          // [num_tokens, num_heads, HEAD_DIM]
    const typename DT::storage* __restrict__ query,  // [num_tokens, num_heads, HEAD_DIM]
    const typename pagedkv::KvRow<KV, DT>::storage* __restrict__ k_cache,
    const typename pagedkv::KvRow<KV, DT>::storage* __restrict__ v_cache,
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
    const int* __restrict__ seq_lens,
    const int* __restrict__ context_lens,
    const int* __restrict__ query_start_loc,
    int max_blocks, int num_heads, int num_kv_heads, int block_size_rt, int min_query_len, float scale, int window,
    float softcap) {
    using namespace pagedkv;
    typedef typename DT::storage T;
    typedef PrefillShape<DT, HEAD_DIM> S;
    typedef KvRow<KV, DT> R;
    constexpr int VEC = S::VEC, QM = S::QM, BN = S::BN, TPI = S::TPI, KPT = S::KPT, DPT = S::DPT, LD = S::LD;
    constexpr int LDP = S::LDP;
    const int block_size = BLOCK_SIZE > 0 ? BLOCK_SIZE : block_size_rt;

    const int seq = blockIdx.x;
    const int kv_head = blockIdx.y;
    const int q_start = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - q_start;
    if (q_len < min_query_len || q_len <= 0) return;
    const int group_size = num_heads / num_kv_heads;
    const int num_items = q_len * group_size;
    const int item0 = blockIdx.z * QM;
    if (item0 >= num_items) return;
    const int seq_len = seq_lens[seq];
    const int ctx = context_lens[seq];
    const int last_row = min(q_len - 1, (item0 + QM - 1) / group_size);
    const int kv_end = min(seq_len, ctx + last_row + 1);  // keys [0, kv_end) can be needed by this tile
    // A sliding window hides keys <= position - window; the tile's first row sees nothing below kv_begin.
    const int kv_begin = window > 0 ? max(0, ctx + item0 / group_size - window + 1) : 0;

    __shared__ float q_s[QM * LD];
    __shared__ float kv_s[BN * LD];
    __shared__ float p_s[QM * LDP];

    const int tid = threadIdx.x;
    // Load the query tile, pre-scaled.
    for (int e = tid; e < QM * S::ROW_VECS; e += PREFILL_THREADS) {
        const int ii = e / S::ROW_VECS;
        const int vi = e % S::ROW_VECS;
        const int item = item0 + ii;
        float f[VEC];
        if (item < num_items) {
            const int row = item / group_size;
            const int head = kv_head * group_size + item % group_size;
            const T* src = query + (static_cast<i64>(q_start + row) * num_heads + head) * HEAD_DIM + vi * VEC;
            unpack16<DT>(load16(src), f);
        } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) f[i] = 0.f;
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) q_s[ii * LD + vi * VEC + i] = f[i] * scale;
    }

    const int my_item = tid / TPI;  // local item index
    const int slot = tid % TPI;     // key slot (scores) and dim slot (output)
    const bool item_valid = item0 + my_item < num_items;
    const int my_limit = item_valid ? ctx + (item0 + my_item) / group_size : -1;  // last key position allowed

    float m_i = -INFINITY;
    float l_i = 0.f;
    float acc[DPT];
#pragma unroll
    for (int j = 0; j < DPT; ++j) acc[j] = 0.f;

    const int* table = block_tables + static_cast<i64>(seq) * max_blocks;

    for (int k0 = kv_begin; k0 < kv_end; k0 += BN) {
        __syncthreads();  // previous tile's readers of kv_s / p_s are done (and q_s is complete)
        // K tile.
        for (int e = tid; e < BN * S::ROW_VECS; e += PREFILL_THREADS) {
            const int kk = e / S::ROW_VECS;
            const int vi = e % S::ROW_VECS;
            const int pos = k0 + kk;
            float f[VEC];
            float row_scale = 1.f;
            if (pos < kv_end) {
                const i64 base = cache_offset(table[pos / block_size], block_size, pos % block_size, num_kv_heads,
                                              kv_head, R::stride(HEAD_DIM));
                R::load(k_cache + base + vi * VEC, f);
                row_scale = R::scale(k_cache + base, HEAD_DIM);
            } else {
#pragma unroll
                for (int i = 0; i < VEC; ++i) f[i] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < VEC; ++i) kv_s[kk * LD + vi * VEC + i] = f[i] * row_scale;
        }
        __syncthreads();

        // Scores for this thread's keys, online softmax update.
        float s[KPT];
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < KPT; ++j) {
            const int kk = slot + j * TPI;
            float dot = 0.f;
#pragma unroll 8
            for (int d = 0; d < HEAD_DIM; ++d) dot += q_s[my_item * LD + d] * kv_s[kk * LD + d];
            if (softcap > 0.f) dot = softcap * tanhf(dot / softcap);  // q was pre-scaled: dot is the score
            const bool in_window = window <= 0 || k0 + kk > my_limit - window;
            s[j] = (k0 + kk <= my_limit && k0 + kk < kv_end && in_window) ? dot : -INFINITY;
            tile_max = fmaxf(tile_max, s[j]);
        }
        tile_max = group_max(tile_max, TPI);
        const float m_new = fmaxf(m_i, tile_max);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = expf(m_i - m_use);
        float psum = 0.f;
#pragma unroll
        for (int j = 0; j < KPT; ++j) {
            const float p = expf(s[j] - m_use);
            p_s[my_item * LDP + slot + j * TPI] = p;
            psum += p;
        }
        psum = group_sum(psum, TPI);
        l_i = l_i * alpha + psum;
        m_i = m_new;
#pragma unroll
        for (int j = 0; j < DPT; ++j) acc[j] *= alpha;
        __syncthreads();  // p_s complete, K reads done

        // V tile into the same buffer.
        for (int e = tid; e < BN * S::ROW_VECS; e += PREFILL_THREADS) {
            const int kk = e / S::ROW_VECS;
            const int vi = e % S::ROW_VECS;
            const int pos = k0 + kk;
            float f[VEC];
            float row_scale = 1.f;
            if (pos < kv_end) {
                const i64 base = cache_offset(table[pos / block_size], block_size, pos % block_size, num_kv_heads,
                                              kv_head, R::stride(HEAD_DIM));
                R::load(v_cache + base + vi * VEC, f);
                row_scale = R::scale(v_cache + base, HEAD_DIM);
            } else {
#pragma unroll
                for (int i = 0; i < VEC; ++i) f[i] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < VEC; ++i) kv_s[kk * LD + vi * VEC + i] = f[i] * row_scale;
        }
        __syncthreads();

        const int nk = min(BN, kv_end - k0);
        for (int kk = 0; kk < nk; ++kk) {
            const float p = p_s[my_item * LDP + kk];
#pragma unroll
            for (int j = 0; j < DPT; ++j) acc[j] += p * kv_s[kk * LD + slot + j * TPI];
        }
    }

    if (!item_valid) return;
    const int item = item0 + my_item;
    const int row = item / group_size;
    const int head = kv_head * group_size + item % group_size;
    const float inv = 1.f / l_i;
    T* dst = out + (static_cast<i64>(q_start + row) * num_heads + head) * HEAD_DIM;
#pragma unroll
    for (int j = 0; j < DPT; ++j) dst[slot + j * TPI] = DT::from_float(acc[j] * inv);
}
