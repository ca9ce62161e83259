"""PyTorch reference paged attention: the semantics the other backends must match.

Clarity first; vectorized over sequences where that costs no clarity, because on
CPU this is also the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.core.attention_metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K/V row to ``slot = block * block_size + offset``; -1 is skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Lay out each sequence's cached rows contiguously: ``[S, max_len, Hkv, D]``.

    Rows past a sequence's length are zeroed, so garbage (even NaN) in unused
    slots cannot reach the output through ``0 * NaN``.
    """
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    blocks_needed = -(-max_len // block_size)
    rows = cache[block_tables[:, :blocks_needed].long()]  # [S, nb, bs, Hkv, D]
    rows = rows.reshape(num_seqs, blocks_needed * block_size, *cache.shape[2:])[:, :max_len]
    invalid = torch.arange(max_len, device=cache.device)[None, :] >= seq_lens[:, None]
    return rows.masked_fill_(invalid[:, :, None, None], 0)  # rows is a fresh copy: fill in place


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, H, D]`` over the paged cache.

    Sequences are padded to the step's longest query and longest history, then
    one SDPA call with GQA handles them all; the mask encodes both the causal
    rule ``key_pos <= context_len + q_pos`` and each sequence's real length.
    """
    num_seqs = meta.num_seqs
    num_heads, head_dim = query.shape[1], query.shape[2]
    max_q, max_kv = meta.max_query_len, meta.max_seq_len
    out_dtype = query.dtype
    compute_dtype = torch.float32 if query.device.type == "cpu" and query.dtype != torch.float32 else query.dtype

    keys = gather_kv(k_cache, meta.block_tables, meta.seq_lens, max_kv).to(compute_dtype)
    values = gather_kv(v_cache, meta.block_tables, meta.seq_lens, max_kv).to(compute_dtype)

    if max_q == 1:
        q = query.reshape(num_seqs, 1, num_heads, head_dim)
    else:
        q = _pad_queries(query, meta, max_q)
    q = q.to(compute_dtype)

    context_lens = meta.context_lens.long()
    q_pos = context_lens[:, None] + torch.arange(max_q, device=query.device)[None, :]  # [S, Q]
    k_pos = torch.arange(max_kv, device=query.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # causal, bottom-right aligned [S, Q, K]
    mask &= k_pos[None, None, :] < meta.seq_lens.long()[:, None, None]
    # Padded query rows would have an all-false mask (NaN softmax); give them key 0.
    mask[:, :, 0] = True

    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=num_heads != keys.shape[2],
    ).transpose(1, 2)  # [S, Q, H, D]

    if max_q == 1:
        return out.reshape(num_seqs, num_heads, head_dim).to(out_dtype)
    return _unpad_queries(out, meta).to(out_dtype)


def _query_index(meta: AttentionMetadata, max_q: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, row) of every packed token, for scattering into a padded layout."""
    lens = torch.tensor(meta.query_lens_cpu, device=device) if meta.query_lens_cpu else (
        meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    ).long()
    seq_idx = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), lens)
    row_idx = torch.arange(seq_idx.shape[0], device=device) - meta.query_start_loc.long()[seq_idx]
    return seq_idx, row_idx


def _pad_queries(query: torch.Tensor, meta: AttentionMetadata, max_q: int) -> torch.Tensor:
    seq_idx, row_idx = _query_index(meta, max_q, query.device)
    padded = query.new_zeros((meta.num_seqs, max_q, *query.shape[1:]))
    padded[seq_idx, row_idx] = query
    return padded


def _unpad_queries(out: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    seq_idx, row_idx = _query_index(meta, out.shape[1], out.device)
    return out[seq_idx, row_idx]


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
    """Copy-on-write support: for every layer, block ``src`` is copied onto ``dst``."""
    if pairs.numel() == 0:
        return
    pairs = pairs.to(kv_caches[0][0].device, torch.int64)
    src, dst = pairs[:, 0], pairs[:, 1]
    for k_cache, v_cache in kv_caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def swap_blocks(
    src: list[tuple[torch.Tensor, torch.Tensor]],
    dst: list[tuple[torch.Tensor, torch.Tensor]],
    pairs: torch.Tensor,
) -> None:
    """Move blocks between two caches on possibly different devices."""
    if pairs.numel() == 0:
        return
    pairs = pairs.to(torch.int64)
    for (sk, sv), (dk, dv) in zip(src, dst):
        s = pairs[:, 0].to(sk.device)
        d = pairs[:, 1].to(dk.device)
        dk[d] = sk[s].to(dk.device)
        dv[d] = sv[s].to(dv.device)
