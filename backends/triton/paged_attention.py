"""Paged attention for a mixed batch: decodes and prefill chunks with earlier cached context, one launch.

Grid: ``(sequence, query tile, KV head)``. A program takes ``BLOCK_Q`` query
tokens of one sequence and all ``GROUP = H // Hkv`` query heads sharing one KV
head: its rows are ``BLOCK_M = BLOCK_Q * GROUP_PAD`` (token-major), at least 16
so that every ``tl.dot`` dimension is >= 16 as a GPU requires. Query row ``j``
of sequence ``i`` sits at position ``context_lens[i] + j`` and sees keys at
positions ``<= context_lens[i] + j`` (causal, aligned bottom-right). Keys and
values come only from the cache. Query tiles past a sequence's length return
at once, so a decode row next to a long prefill costs one small program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.backends.base import check_window
from pagedkv.backends.triton.attn_tile import attend_rows, interpreted
from pagedkv.core.kv.kv_dtype import is_quantized, row_width

LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    cap_log2e,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
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
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
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
    q_tile_start = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile_start >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile_start + offs_m // GROUP_PAD
    in_group = offs_m % GROUP_PAD
    row_mask = (q_idx < q_len) & (in_group < GROUP)
    token = (q_start + q_idx).to(tl.int64)
    head = (kv_head * GROUP + in_group).to(tl.int64)
    offs_d = tl.arange(0, D_PAD).to(tl.int64)
    mask = row_mask[:, None] & (offs_d[None, :] < HEAD_DIM)

    q_pos = context_len + q_idx
    # The last row of this tile sees keys up to its own position; nothing past the history exists.
    kv_end = tl.minimum(context_len + tl.minimum(q_tile_start + BLOCK_Q, q_len), seq_len)
    # With a sliding window, the first row of this tile sees nothing below its own position - window + 1.
    kv_start = tl.where(window > 0, tl.maximum(context_len + q_tile_start - window + 1, 0), 0)

    acc, m_i, l_i = attend_rows(
        q_ptr, token * stride_qt + head * stride_qh, row_mask, stride_qd, qk_scale, cap_log2e, q_pos, window,
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head,
        stride_kb, stride_ks, stride_kh, stride_kd, stride_vb, stride_vs, stride_vh, stride_vd, kv_start, kv_end,
        BLOCK_M, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, SOFTCAP, IEEE, INTERPRET, QUANT,
    )
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # rows that saw no key (none in a consistent batch) give 0, not NaN
    out = acc / l_i[:, None]
    o_rows = token * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=mask)


def rows_per_program(group_pad: int, max_query_len: int) -> int:
    """Query tokens per program: one for decode-like steps, more for prefill, always >= 16 rows."""
    target_rows = 16 if max_query_len <= 1 else 64
    return max(1, target_rows // group_pad)


def use_ieee_dot(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """fp32 data needs ``input_precision="ieee"`` to match the reference (the GPU would use TF32).

    fp16 and bf16 values are exact in TF32 (``q`` is scaled after the dot; a dequantized 8-bit value is
    not exact, so it gets IEEE too), so
    with 16-bit inputs only the probabilities of ``P @ V`` are rounded to TF32,
    about as finely as an fp16 output. Under the interpreter the precision
    hint is ignored (numpy computes in fp32), so only a GPU run exercises TF32.
    """
    return query.dtype == torch.float32 or k_cache.dtype not in (torch.float16, torch.bfloat16)


def scale_view(cache: torch.Tensor) -> torch.Tensor:
    """What the kernels read an 8-bit cache's row scales through: its bytes as uint8 (else the cache itself)."""
    return cache.view(torch.uint8) if is_quantized(cache.dtype) else cache


def score_args(scale: float, softcap: float | None) -> tuple[float, float, bool]:
    """``(qk_scale, cap_log2e, SOFTCAP)`` for the kernels: base-2 scores, capped when ``softcap`` is set."""
    if softcap:
        return scale / softcap, softcap * LOG2E, True
    return scale * LOG2E, 0.0, False


def window_arg(window: int | None) -> int:
    """The kernels' ``window`` argument: 0 for none."""
    check_window(window)
    return int(window or 0)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    tile_n: int = 64,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention of packed ``query`` ``[T, H, D]``; writes and returns ``out`` ``[T, H, D]``.

    ``window``/``softcap``: see ``AttentionBackend.attend``.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if k_cache.shape[3] != row_width(head_dim, k_cache.dtype) or v_cache.shape != k_cache.shape:
        shapes = f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)}"
        raise ValueError(f"caches {shapes} do not match query {tuple(query.shape)}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = rows_per_program(group_pad, max_query_len)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    qk_scale, cap_log2e, use_softcap = score_args(scale, softcap)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        scale_view(k_cache),
        scale_view(v_cache),
        block_tables,
        seq_lens,
        context_lens,
        query_start_loc,
        qk_scale,
        cap_log2e,
        window_arg(window),
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=k_cache.shape[1],
        TILE_N=max(16, tile_n),
        SOFTCAP=use_softcap,
        IEEE=use_ieee_dot(query, k_cache),
        INTERPRET=interpreted(),
        QUANT=is_quantized(k_cache.dtype),
    )
    return out
