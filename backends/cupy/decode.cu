// Paged decode attention: sequences whose step has exactly one query row.
//
// Grid (num_seqs, num_kv_heads * head_tiles, num_partitions), 128 threads.
// A thread block owns one KV head, a tile of up to G_TILE of the query heads
// that share it (GQA), and one partition of the sequence's history. Each K and
// V row of the partition is read from global memory once, as 16-byte vectors,
// and used for every query head of the tile (when a KV head has more than
// G_TILE query heads, each extra tile reads the rows again).
//
// Threads form row groups of TPR lanes; a row group walks the partition's
// tokens, TPR lanes covering one head_dim row. Phase 1 scores each token
// against the tile's heads into shared memory, phase 2 takes the softmax per
// head (one warp per head), phase 3 accumulates P.V in registers, and the row
// groups' partial sums are reduced through shared memory. One partition writes
// the output directly; several write fp32 partials (max, sum, acc) that
// pagedkv_decode_reduce combines. Only tokens < seq_len are read, so the unused
// tail of the last block (and any unused slot) never reaches the math.
#include "common.cuh"
#include "kv_row.cuh"

namespace pagedkv {

constexpr int DECODE_THREADS = 128;

template <typename DT, int HEAD_DIM>
struct DecodeShape {
    static constexpr int VEC = Vec<DT>::N;                         // elements per 16-byte load
    static constexpr int ROW_VECS = HEAD_DIM / VEC;                // 16-byte vectors per row
    static constexpr int TPR = min_int(32, next_pow2(ROW_VECS));   // lanes per row
    static constexpr int VPT = ceil_div(ROW_VECS, TPR);            // vectors per lane
    static constexpr int ELEMS = VPT * VEC;                        // row elements per lane
    static constexpr int GROUPS = DECODE_THREADS / TPR;            // row groups per block
    static_assert(HEAD_DIM % VEC == 0, "head_dim * sizeof(dtype) must be a multiple of 16 bytes");
};

}  // namespace pagedkv

// Dynamic shared memory: G_TILE * partition_size floats (scores, then probabilities),
// 2 * G_TILE floats (max, sum), then GROUPS / 2 * G_TILE * ELEMS * TPR floats (reduction).
// KV: the cache's row format (kv_row.cuh); the lane layout follows the query dtype DT either way.
template <typename DT, int HEAD_DIM, int BLOCK_SIZE, int G_TILE, typename KV = pagedkv::KvSame>
__global__ void __launch_bounds__(pagedkv::DECODE_THREADS) pagedkv_decode(
    typename DT::storage* __restrict__ out,          // [num_tokens, num_heads, HEAD_DIM]
    float* __restrict__ part_acc,                    // [num_seqs, num_heads, max_parts, HEAD_DIM]
    float* __restrict__ part_max,                    // [num_seqs, num_heads, max_parts]
    float* __restrict__ part_sum,                    // [num_seqs, num_heads, max_parts]
    const typename DT::storage* __restrict__ query,  // [num_tokens, num_heads, HEAD_DIM]
    const typename pagedkv::KvRow<KV, DT>::storage* __restrict__ k_cache,
    const typename pagedkv::KvRow<KV, DT>::storage* __restrict__ v_cache,
    const int* __restrict__ block_tables,  // [num_seqs, max_blocks]
    const int* __restrict__ seq_lens,
    const int* __restrict__ query_start_loc,
    int max_blocks, int num_heads, int num_kv_heads, int partition_size, int max_parts, int block_size_rt,
    float scale, int window, float softcap) {
    using namespace pagedkv;
    typedef typename DT::storage T;
    typedef DecodeShape<DT, HEAD_DIM> S;
    typedef KvRow<KV, DT> R;
    constexpr int VEC = S::VEC, TPR = S::TPR, VPT = S::VPT, ELEMS = S::ELEMS, GROUPS = S::GROUPS;
    const int block_size = BLOCK_SIZE > 0 ? BLOCK_SIZE : block_size_rt;

    const int seq = blockIdx.x;
    const int q_row = query_start_loc[seq];
    if (query_start_loc[seq + 1] - q_row != 1) return;  // not a decode sequence this step
    const int seq_len = seq_lens[seq];
    const int part = blockIdx.z;
    // With a sliding window only the last `window` tokens are attended: partitions cover [lo, seq_len).
    const int lo = window > 0 ? max(0, seq_len - window) : 0;
    const int start = lo + part * partition_size;
    if (start >= seq_len) return;
    const int n = min(partition_size, seq_len - start);
    const int num_parts = (seq_len - lo + partition_size - 1) / partition_size;

    const int group_size = num_heads / num_kv_heads;
    const int head_tiles = (group_size + G_TILE - 1) / G_TILE;
    const int kv_head = blockIdx.y / head_tiles;
    const int g0 = (blockIdx.y % head_tiles) * G_TILE;
    const int gn = min(G_TILE, group_size - g0);
    const int head0 = kv_head * group_size + g0;

    const int tid = threadIdx.x;
    const int grp = tid / TPR;
    const int lane = tid % TPR;

    extern __shared__ float smem[];
    float* logits = smem;                               // [G_TILE][partition_size]
    float* stat_max = logits + G_TILE * partition_size;  // [G_TILE]
    float* stat_sum = stat_max + G_TILE;                 // [G_TILE]
    float* red = stat_sum + G_TILE;                      // [GROUPS/2][G_TILE][ELEMS][TPR]

    // This lane's slice of every query head of the tile, pre-scaled, in registers.
    float q[G_TILE][ELEMS];
#pragma unroll
    for (int g = 0; g < G_TILE; ++g) {
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int v = lane + j * TPR;
            if (g < gn && v < S::ROW_VECS) {
                const T* src = query + (static_cast<i64>(q_row) * num_heads + head0 + g) * HEAD_DIM + v * VEC;
                unpack16<DT>(load16(src), &q[g][j * VEC]);
#pragma unroll
                for (int i = 0; i < VEC; ++i) q[g][j * VEC + i] *= scale;
            } else {
#pragma unroll
                for (int i = 0; i < VEC; ++i) q[g][j * VEC + i] = 0.f;
            }
        }
    }

    const int* table = block_tables + static_cast<i64>(seq) * max_blocks;
    // Uniform trip count so every lane reaches the shuffles.
    const int rounds = (n + GROUPS - 1) / GROUPS;

    // Phase 1: scores.
    for (int r = 0; r < rounds; ++r) {
        const int t = r * GROUPS + grp;
        const bool valid = t < n;
        float k[ELEMS];
        float k_scale = 1.f;
        if (valid) {
            const int pos = start + t;
            const i64 base = cache_offset(table[pos / block_size], block_size, pos % block_size, num_kv_heads,
                                          kv_head, R::stride(HEAD_DIM));
            k_scale = R::scale(k_cache + base, HEAD_DIM);
#pragma unroll
            for (int j = 0; j < VPT; ++j) {
                const int v = lane + j * TPR;
                if (v < S::ROW_VECS) {
                    R::load(k_cache + base + v * VEC, &k[j * VEC]);
                } else {
#pragma unroll
                    for (int i = 0; i < VEC; ++i) k[j * VEC + i] = 0.f;
                }
            }
        } else {
#pragma unroll
            for (int i = 0; i < ELEMS; ++i) k[i] = 0.f;
        }
#pragma unroll
        for (int g = 0; g < G_TILE; ++g) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < ELEMS; ++i) dot += q[g][i] * k[i];
            dot = group_sum(dot, TPR) * k_scale;
            if (softcap > 0.f) dot = softcap * tanhf(dot / softcap);  // q was pre-scaled: dot is the score
            if (valid && lane == 0 && g < gn) logits[g * partition_size + t] = dot;
        }
    }
    __syncthreads();

    // Phase 2: softmax per head, one warp per head; probabilities overwrite the scores.
    const int warp = tid / 32;
    const int wlane = tid % 32;
    for (int g = warp; g < gn; g += DECODE_THREADS / 32) {
        float* row = logits + g * partition_size;
        float m = -INFINITY;
        for (int t = wlane; t < n; t += 32) m = fmaxf(m, row[t]);
        m = group_max(m, 32);
        float s = 0.f;
        for (int t = wlane; t < n; t += 32) {
            const float p = expf(row[t] - m);
            row[t] = p;
            s += p;
        }
        s = group_sum(s, 32);
        if (wlane == 0) {
            stat_max[g] = m;
            stat_sum[g] = s;
        }
    }
    __syncthreads();

    // Phase 3: P.V, each V row loaded once for all heads of the tile.
    float acc[G_TILE][ELEMS];
#pragma unroll
    for (int g = 0; g < G_TILE; ++g) {
#pragma unroll
        for (int i = 0; i < ELEMS; ++i) acc[g][i] = 0.f;
    }
    for (int t = grp; t < n; t += GROUPS) {
        const int pos = start + t;
        const i64 base = cache_offset(table[pos / block_size], block_size, pos % block_size, num_kv_heads, kv_head,
                                      R::stride(HEAD_DIM));
        const float v_scale = R::scale(v_cache + base, HEAD_DIM);
        float v[ELEMS];
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
            const int vi = lane + j * TPR;
            if (vi < S::ROW_VECS) {
                R::load(v_cache + base + vi * VEC, &v[j * VEC]);
            } else {
#pragma unroll
                for (int i = 0; i < VEC; ++i) v[j * VEC + i] = 0.f;
            }
        }
#pragma unroll
        for (int g = 0; g < G_TILE; ++g) {
            if (g < gn) {
                const float p = logits[g * partition_size + t] * v_scale;
#pragma unroll
                for (int i = 0; i < ELEMS; ++i) acc[g][i] += p * v[i];
            }
        }
    }

    // Tree reduction of the row groups' partial sums into row group 0 (not unrolled: code size).
#pragma unroll 1
    for (int half = GROUPS / 2; half >= 1; half /= 2) {
        if (grp >= half && grp < 2 * half) {
#pragma unroll
            for (int g = 0; g < G_TILE; ++g) {
#pragma unroll
                for (int i = 0; i < ELEMS; ++i) red[(((grp - half) * G_TILE + g) * ELEMS + i) * TPR + lane] = acc[g][i];
            }
        }
        __syncthreads();
        if (grp < half) {
#pragma unroll
            for (int g = 0; g < G_TILE; ++g) {
#pragma unroll
                for (int i = 0; i < ELEMS; ++i) acc[g][i] += red[((grp * G_TILE + g) * ELEMS + i) * TPR + lane];
            }
        }
        __syncthreads();
    }
    if (grp != 0) return;

#pragma unroll
    for (int g = 0; g < G_TILE; ++g) {
        if (g >= gn) continue;
        const int head = head0 + g;
        if (num_parts == 1) {
            const float inv = 1.f / stat_sum[g];
#pragma unroll
            for (int j = 0; j < VPT; ++j) {
                const int vi = lane + j * TPR;
                if (vi >= S::ROW_VECS) continue;
                float o[VEC];
#pragma unroll
                for (int i = 0; i < VEC; ++i) o[i] = acc[g][j * VEC + i] * inv;
                store16(out + (static_cast<i64>(q_row) * num_heads + head) * HEAD_DIM + vi * VEC, pack16<DT>(o));
            }
        } else {
            const i64 idx = (static_cast<i64>(seq) * num_heads + head) * max_parts + part;
            if (lane == 0) {
                part_max[idx] = stat_max[g];
                part_sum[idx] = stat_sum[g];
            }
#pragma unroll
            for (int j = 0; j < VPT; ++j) {
                const int vi = lane + j * TPR;
                if (vi >= S::ROW_VECS) continue;
                float* dst = part_acc + idx * HEAD_DIM + vi * VEC;
#pragma unroll
                for (int i = 0; i < VEC; ++i) dst[i] = acc[g][j * VEC + i];
            }
        }
    }
}

// Combine the partitions of long sequences. Grid (num_seqs, num_heads), 128 threads.
template <typename DT, int HEAD_DIM>
__global__ void __launch_bounds__(128) pagedkv_decode_reduce(
    typename DT::storage* __restrict__ out,  // [num_tokens, num_heads, HEAD_DIM]
    const float* __restrict__ part_acc, const float* __restrict__ part_max, const float* __restrict__ part_sum,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc, int num_heads, int partition_size,
    int max_parts, int window) {
    using namespace pagedkv;
    const int seq = blockIdx.x;
    const int head = blockIdx.y;
    const int q_row = query_start_loc[seq];
    if (query_start_loc[seq + 1] - q_row != 1) return;
    const int seen = window > 0 ? min(seq_lens[seq], window) : seq_lens[seq];  // tokens the partitions cover
    const int num_parts = (seen + partition_size - 1) / partition_size;
    if (num_parts <= 1) return;  // written directly by pagedkv_decode
    const i64 base = (static_cast<i64>(seq) * num_heads + head) * max_parts;
    float m = -INFINITY;
    for (int p = 0; p < num_parts; ++p) m = fmaxf(m, part_max[base + p]);
    float denom = 0.f;
    for (int p = 0; p < num_parts; ++p) denom += expf(part_max[base + p] - m) * part_sum[base + p];
    const float inv = 1.f / denom;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float o = 0.f;
        for (int p = 0; p < num_parts; ++p) o += expf(part_max[base + p] - m) * part_acc[(base + p) * HEAD_DIM + d];
        out[(static_cast<i64>(q_row) * num_heads + head) * HEAD_DIM + d] = DT::from_float(o * inv);
    }
}
