"""PyTorch reference paged attention: the semantics the other backends must match.

Clarity first; vectorized over sequences where that costs no clarity, because on
CPU this is also the fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.core.kv.attention_metadata import AttentionMetadata, slots_all_valid
from pagedkv.core.kv.kv_dtype import byte_view, dequantize_rows, is_quantized, quantize_rows


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter each token's K/V row to ``slot = block * block_size + offset``; -1 is skipped.

    Slots built by :class:`AttentionMetadata` are known to be valid, so the engine's
    path never asks the device whether any is -1 (a host sync per layer on CUDA).
    An 8-bit cache gets each row quantized with its scale (``core/kv/kv_dtype.py``), in the same one scatter.
    """
    if not slots_all_valid(slot_mapping):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    heads, width = k_cache.shape[2], k_cache.shape[3]
    for rows, cache in ((key, k_cache), (value, v_cache)):
        rows = quantize_rows(rows, cache.dtype) if is_quantized(cache.dtype) else rows.to(cache.dtype)
        byte_view(cache).view(-1, heads, width).index_copy_(0, slot_mapping, byte_view(rows))


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, min_len: int = 0
) -> torch.Tensor:
    """Lay out each sequence's cached rows contiguously: ``[S, max_len, Hkv, D]``.

    Rows past a sequence's length are zeroed, so garbage (even NaN) in unused
    slots cannot reach the output through ``0 * NaN``. Rows before ``min_len``
    (the shortest sequence) are valid everywhere, so only the tail is scanned.
    """
    dtype, cache = cache.dtype, byte_view(cache)
    num_seqs = block_tables.shape[0]
    block_size = cache.shape[1]
    blocks_needed = -(-max_len // block_size)
    blocks = block_tables[:, :blocks_needed].reshape(-1).long()
    rows = cache.index_select(0, blocks)  # [S * nb, bs, Hkv, D]; index_select is much faster than cache[table]
    rows = rows.view(num_seqs, blocks_needed * block_size, *cache.shape[2:])[:, :max_len]
    invalid = torch.arange(min_len, max_len, device=cache.device)[None, :] >= seq_lens[:, None]
    rows[:, min_len:].masked_fill_(invalid[:, :, None, None], 0)  # rows is a fresh copy: fill in place
    return rows.view(dtype)


def step_mask(meta: AttentionMetadata, device: torch.device, window: int | None = None) -> torch.Tensor:
    """``[S, 1, Q, K]`` boolean mask: causal (bottom-right aligned), within each sequence's length and,
    with a sliding ``window``, only the last ``window`` positions up to the query's own.

    The same for every layer with the same window, so it is built once per step and kept on the metadata.
    """
    key = f"torch_ref.mask.{window}"
    cached = meta.backend_cache.get(key)
    if cached is not None:
        return cached
    q_pos = meta.context_lens.long()[:, None] + torch.arange(meta.max_query_len, device=device)[None, :]  # [S, Q]
    k_pos = torch.arange(meta.max_seq_len, device=device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [S, Q, K]
    mask &= k_pos[None, None, :] < meta.seq_lens.long()[:, None, None]
    if window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    # Padded query rows would have an all-false mask (NaN softmax); give them key 0 (their output is dropped).
    query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    padded_row = torch.arange(meta.max_query_len, device=device)[None, :] >= query_lens[:, None]  # [S, Q]
    mask[:, :, 0] |= padded_row
    meta.backend_cache[key] = mask = mask[:, None]
    return mask


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention of packed queries ``[T, H, D]`` over the paged cache.

    Sequences are padded to the step's longest query and longest history, then
    one attention call with GQA handles them all; the mask encodes the causal
    rule ``key_pos <= context_len + q_pos``, each sequence's real length and
    the sliding window. ``window``/``softcap``: see ``AttentionBackend.attend``.
    """
    num_seqs = meta.num_seqs
    num_heads, head_dim = query.shape[1], query.shape[2]
    max_q, max_kv = meta.max_query_len, meta.max_seq_len
    out_dtype = query.dtype
    compute_dtype = torch.float32 if query.device.type == "cpu" and query.dtype != torch.float32 else query.dtype

    min_kv = min(meta.seq_lens_cpu) if meta.seq_lens_cpu else 0
    keys = gather_kv(k_cache, meta.block_tables, meta.seq_lens, max_kv, min_kv)
    values = gather_kv(v_cache, meta.block_tables, meta.seq_lens, max_kv, min_kv)
    if is_quantized(k_cache.dtype):  # dequantize in the gather: only the rows this step reads
        keys, values = dequantize_rows(keys, head_dim, compute_dtype), dequantize_rows(values, head_dim, compute_dtype)
    else:
        keys, values = keys.to(compute_dtype), values.to(compute_dtype)

    if max_q == 1:
        q = query.reshape(num_seqs, 1, num_heads, head_dim)
    else:
        q = _pad_queries(query, meta, max_q)
    q = q.to(compute_dtype)

    out = attention_math(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        step_mask(meta, query.device, window),
        scale,
        softcap,
    ).transpose(1, 2)  # [S, Q, H, D]

    if max_q == 1:
        return out.reshape(num_seqs, num_heads, head_dim).to(out_dtype)
    return _unpad_queries(out, meta).to(out_dtype)


def attention_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """``softmax(cap(scale * q k^T) masked) v`` for ``q`` ``[S, H, Q, D]``, ``k``/``v`` ``[S, Hkv, K, D]``.

    Without softcapping this is one SDPA call. SDPA cannot cap the scores, so
    then the scores are computed explicitly, in the order transformers' eager
    Gemma 2 attention uses (scale, divide by the cap, tanh, multiply, mask,
    fp32 softmax), so greedy tokens match it exactly.
    """
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _query_index(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, row) of every packed token, for scattering into a padded layout; once per step.

    Computed on the device from ``query_start_loc`` with the token count known
    on the host (``output_size``), so nothing waits for the device.
    """
    cached = meta.backend_cache.get("torch_ref.query_index")
    if cached is not None:
        return cached
    starts = meta.query_start_loc.long()
    lens = starts[1:] - starts[:-1]
    seq_idx = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=device), lens, output_size=meta.num_tokens
    )
    row_idx = torch.arange(meta.num_tokens, device=device) - starts[seq_idx]
    meta.backend_cache["torch_ref.query_index"] = seq_idx, row_idx
    return seq_idx, row_idx


def _pad_queries(query: torch.Tensor, meta: AttentionMetadata, max_q: int) -> torch.Tensor:
    seq_idx, row_idx = _query_index(meta, query.device)
    padded = query.new_zeros((meta.num_seqs, max_q, *query.shape[1:]))
    padded[seq_idx, row_idx] = query
    return padded


def _unpad_queries(out: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    seq_idx, row_idx = _query_index(meta, out.device)
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
    """Move blocks between two caches on possibly different devices.

    Between CUDA and the CPU the blocks travel through a pinned staging buffer
    (a gather into pageable memory would make the copy both slower and
    blocking): out of the GPU, gather there, one copy into pinned memory, then
    scatter into the CPU pool; into the GPU, gather into pinned memory, one
    non-blocking copy, scatter on the GPU. Index tensors move once per call.
    """
    if pairs.numel() == 0:
        return
    pairs = pairs.to(torch.int64).reshape(-1, 2)
    index: dict[tuple[int, torch.device], torch.Tensor] = {}

    def column(col: int, device: torch.device) -> torch.Tensor:
        if (col, device) not in index:
            index[(col, device)] = pairs[:, col].to(device)
        return index[(col, device)]

    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        for s_cache, d_cache in ((sk, dk), (sv, dv)):
            _move_blocks(byte_view(s_cache), byte_view(d_cache), column(0, s_cache.device), column(1, d_cache.device))


def _move_blocks(src: torch.Tensor, dst: torch.Tensor, s: torch.Tensor, d: torch.Tensor) -> None:
    if src.device == dst.device:
        dst.index_copy_(0, d, src.index_select(0, s))
        return
    pin = torch.cuda.is_available() and "cuda" in (src.device.type, dst.device.type)
    staging = torch.empty((s.numel(), *src.shape[1:]), dtype=src.dtype, pin_memory=pin)
    if src.device.type == "cpu":
        torch.index_select(src, 0, s, out=staging)
        dst.index_copy_(0, d, staging.to(dst.device, non_blocking=pin).to(dst.dtype))
    else:
        staging.copy_(src.index_select(0, s))  # waits for the device: the CPU scatter below needs the data
        dst.index_copy_(0, d, staging.to(dst.dtype))
