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
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, min_len: int = 0
) -> torch.Tensor:
    """Lay out each sequence's cached rows contiguously: ``[S, max_len, Hkv, D]``.

    Rows past a sequence's length are zeroed, so garbage (even NaN) in unused
    slots cannot reach the output through ``0 * NaN``. Rows before ``min_len``
    (the shortest sequence) are valid everywhere, so only the tail is scanned.
    """
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    blocks_needed = -(-max_len // block_size)
    blocks = block_tables[:, :blocks_needed].reshape(-1).long()
    rows = cache.index_select(0, blocks)  # [S * nb, bs, Hkv, D]; index_select is ~5x faster than cache[table]
    rows = rows.view(num_seqs, blocks_needed * block_size, *cache.shape[2:])[:, :max_len]
    invalid = torch.arange(min_len, max_len, device=cache.device)[None, :] >= seq_lens[:, None]
    rows[:, min_len:].masked_fill_(invalid[:, :, None, None], 0)  # rows is a fresh copy: fill in place
    return rows


def step_mask(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """``[S, 1, Q, K]`` boolean mask: causal (bottom-right aligned) and within each sequence's length.

    The same for every layer, so it is built once per step and kept on the metadata.
    """
    cached = meta.backend_cache.get("torch_ref.mask")
    if cached is not None:
        return cached
    q_pos = meta.context_lens.long()[:, None] + torch.arange(meta.max_query_len, device=device)[None, :]  # [S, Q]
    k_pos = torch.arange(meta.max_seq_len, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, K]
    mask &= k_pos[None, None, :] < meta.seq_lens.long()[:, None, None]
    # Padded query rows would have an all-false mask (NaN softmax); give them key 0.
    mask[:, :, 0] = True
    meta.backend_cache["torch_ref.mask"] = mask = mask[:, None]
    return mask


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

    min_kv = min(meta.seq_lens_cpu) if meta.seq_lens_cpu else 0
    keys = gather_kv(k_cache, meta.block_tables, meta.seq_lens, max_kv, min_kv).to(compute_dtype)
    values = gather_kv(v_cache, meta.block_tables, meta.seq_lens, max_kv, min_kv).to(compute_dtype)

    if max_q == 1:
        q = query.reshape(num_seqs, 1, num_heads, head_dim)
    else:
        q = _pad_queries(query, meta, max_q)
    q = q.to(compute_dtype)

    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=step_mask(meta, query.device),
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
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        s = pairs[:, 0].to(sk.device)
        d = pairs[:, 1].to(dk.device)
        dk[d] = sk[s].to(dk.device)
        dv[d] = sv[s].to(dv.device)
