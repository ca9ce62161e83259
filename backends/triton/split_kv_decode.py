"""Split-KV decode (flash-decoding): long contexts with few sequences use more of the GPU.

Each decode sequence's history is cut into ``num_splits`` ranges of
``split_len`` keys. Pass 1, grid ``(sequence, KV head, split)``: each program
runs the shared online-softmax loop over its range for the whole GQA group and
stores the normalised partial output and its log-sum-exp (base 2). A split that
starts past the sequence's length returns without writing anything. Pass 2,
grid ``(sequence, query head)``: merges only the ``cdiv(seq_len, split_len)``
splits that hold keys, so the scratch entries of empty splits are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.backends.triton.attn_tile import attend_rows, interpreted, max_along, sum_along
from pagedkv.backends.triton.paged_attention import scale_view, score_args, use_ieee_dot, window_arg
from pagedkv.core.kv.kv_dtype import is_quantized


@triton.jit
def _split_kv_partial_kernel(
    part_out_ptr,  # fp32 [S, num_splits, H, D]
    part_lse_ptr,  # fp32 [S, num_splits, H]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    cap_log2e,
    window,
    split_len,
    stride_pos,
    stride_psp,
    stride_ph,
    stride_pd,
    stride_ls,
    stride_lsp,
    stride_lh,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the splits cover [lo, seq_len)
    kv_start = lo + split * split_len
    if kv_start >= seq_len:
        return  # empty split: the reduce never reads it
    kv_end = tl.minimum(kv_start + split_len, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < GROUP
    head = (kv_head * GROUP + offs_m).to(tl.int64)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    offs_d = tl.arange(0, D_PAD).to(tl.int64)
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_pos = tl.full([BLOCK_M], 0, dtype=tl.int32) + (seq_len - 1)  # the decode token is the last position

    acc, m_i, l_i = attend_rows(
        q_ptr, token * stride_qt + head * stride_qh, row_mask, stride_qd, qk_scale, cap_log2e, q_pos, window,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, kv_start, kv_end,
        BLOCK_M, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, SOFTCAP, IEEE, INTERPRET, QUANT,
    )
    # A non-empty split always has visible keys, so l_i > 0 on every real row.
    seq64 = seq.to(tl.int64)
    split64 = split.to(tl.int64)
    p_rows = seq64 * stride_pos + split64 * stride_psp + head * stride_ph
    tl.store(part_out_ptr + p_rows[:, None] + offs_d[None, :] * stride_pd, acc / l_i[:, None], mask=mask)
    lse = m_i + tl.log2(l_i)
    tl.store(part_lse_ptr + seq64 * stride_ls + split64 * stride_lsp + head * stride_lh, lse, mask=row_mask)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    window,
    split_len,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    stride_pos,
    stride_psp,
    stride_ph,
    stride_pd,
    stride_ls,
    stride_lsp,
    stride_lh,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    seen = tl.where(window > 0, tl.minimum(seq_len, window), seq_len)  # keys the splits cover
    used = tl.minimum((seen + split_len - 1) // split_len, num_splits)  # splits past the history were never written

    offs_s = tl.arange(0, SPLITS_PAD).to(tl.int64)
    offs_d = tl.arange(0, D_PAD).to(tl.int64)
    s_mask = offs_s < used
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + seq * stride_ls + offs_s * stride_lsp + head * stride_lh, mask=s_mask, other=0.0)
    lse = tl.where(s_mask, lse, float("-inf"))
    lse_max = max_along(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.where(s_mask, tl.exp2(lse - lse_max), 0.0)
    part_rows = seq * stride_pos + offs_s * stride_psp + head * stride_ph
    part_mask = s_mask[:, None] & d_mask[None, :]
    part = tl.load(part_out_ptr + part_rows[:, None] + offs_d[None, :] * stride_pd, mask=part_mask, other=0.0)
    total = sum_along(weight, 0)
    total = tl.where(total > 0.0, total, 1.0)
    out = sum_along(part * weight[:, None], 0) / total
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    o_row = out_ptr + token * stride_ot + head * stride_oh
    tl.store(o_row + offs_d * stride_od, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, target_programs: int = 256, min_split_len: int = 256
) -> int:
    """How many splits to use: enough programs to fill a GPU, each split at least ``min_split_len`` keys."""
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= target_programs or max_seq_len < 2 * min_split_len:
        return 1
    return max(1, min(triton.cdiv(target_programs, programs), max_seq_len // min_split_len, 64))


def split_layout(max_seq_len: int, num_splits: int, tile_n: int = 64) -> tuple[int, int]:
    """``(split_len, num_splits)``: splits are whole tiles, and none lies wholly past ``max_seq_len``."""
    tile_n = max(16, tile_n)
    split_len = triton.cdiv(triton.cdiv(max(1, max_seq_len), max(1, num_splits)), tile_n) * tile_n
    return split_len, triton.cdiv(max(1, max_seq_len), split_len)


def split_kv_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    tile_n: int = 64,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Decode attention (one query token per sequence) split over the key axis, then merged.

    With a sliding ``window`` only the last ``window`` keys of each sequence are
    split (``max_seq_len`` is capped to it); ``softcap`` caps the scores.

    ``part_out`` ``[S, num_splits, H, D]`` and ``part_lse`` ``[S, num_splits, H]``
    (fp32) are scratch; they are allocated when not given. Splits are
    ``split_len = cdiv(max_seq_len, num_splits)`` keys rounded up to ``tile_n``,
    so shorter sequences leave their last splits empty.
    """
    num_tokens, num_heads, _ = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    if num_tokens != num_seqs:
        raise ValueError(f"split-KV decode needs one query token per sequence, got {num_tokens} for {num_seqs}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0 or max_seq_len == 0:
        return out
    window = window_arg(window)
    covered = min(max_seq_len, window) if window else max_seq_len
    split_len, num_splits = split_layout(covered, num_splits, tile_n)
    part_out, part_lse = _scratch(query, num_seqs, num_splits, part_out, part_lse)
    _launch_partial(part_out, part_lse, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                    scale, softcap, window, split_len, max(16, tile_n))
    _launch_reduce(out, part_out, part_lse, seq_lens, query_start_loc, window, split_len, query.shape)
    return out


def _scratch(
    query: torch.Tensor, num_seqs: int, num_splits: int, part_out: torch.Tensor | None, part_lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-split partial outputs and log-sum-exps: the caller's, checked, or new ones."""
    _, num_heads, head_dim = query.shape
    if part_out is None:
        part_out = torch.empty((num_seqs, num_splits, num_heads, head_dim), dtype=torch.float32, device=query.device)
    if part_lse is None:
        part_lse = torch.empty((num_seqs, num_splits, num_heads), dtype=torch.float32, device=query.device)
    if part_out.shape[:2] != (num_seqs, num_splits) or part_lse.shape[:2] != (num_seqs, num_splits):
        raise ValueError(f"scratch buffers must start with ({num_seqs}, {num_splits})")
    return part_out, part_lse


def _launch_partial(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int,
    split_len: int,
    tile_n: int,
) -> None:
    """One program per (sequence, KV head, split): that split's attention and its log-sum-exp."""
    num_seqs, num_splits = part_out.shape[:2]
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    qk_scale, cap_log2e, use_softcap = score_args(scale, softcap)
    _split_kv_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        part_out,
        part_lse,
        query,
        k_cache,
        v_cache,
        scale_view(k_cache),
        scale_view(v_cache),
        block_tables,
        seq_lens,
        query_start_loc,
        qk_scale,
        cap_log2e,
        window,
        split_len,
        *part_out.stride(),
        *part_lse.stride(),
        *query.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=tile_n,
        SOFTCAP=use_softcap,
        IEEE=use_ieee_dot(query, k_cache),
        INTERPRET=interpreted(),
        QUANT=is_quantized(k_cache.dtype),
    )


def _launch_reduce(
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    window: int,
    split_len: int,
    query_shape: torch.Size,
) -> None:
    """One program per (sequence, query head): the splits merged by their log-sum-exps into ``out``."""
    num_seqs, num_splits = part_out.shape[:2]
    _, num_heads, head_dim = query_shape
    _split_kv_reduce_kernel[(num_seqs, num_heads)](
        out,
        part_out,
        part_lse,
        seq_lens,
        query_start_loc,
        window,
        split_len,
        num_splits,
        *out.stride(),
        *part_out.stride(),
        *part_lse.stride(),
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
    )
