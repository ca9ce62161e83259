"""Paged attention test cases and their float64 reference, shared by every backend's kernel tests."""

from __future__ import annotations

import math

import torch

from pagedkv.core.kv.attention_metadata import AttentionMetadata
from pagedkv.core.kv.kv_dtype import (
    SCALE_NAN,
    byte_view,
    dequantize_rows,
    is_quantized,
    quantize_rows,
    row_width,
    split_cache,
)


def reference(q, k, v, context_len, scale, window=None, softcap=None):
    """float64, contiguous, GQA expanded: q [Q, H, D] at positions context_len.., k/v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = context_len + torch.arange(q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def poisoned_cache(num_blocks, block_size, kv_heads, dim, kv_dtype):
    """A cache whose every slot reads as NaN: NaN values, or (8-bit) junk values with a NaN scale (code 255)."""
    cache = torch.empty((num_blocks, block_size, kv_heads, row_width(dim, kv_dtype)), dtype=kv_dtype)
    if not is_quantized(kv_dtype):
        return cache.fill_(float("nan"))
    byte_view(cache).fill_(77)
    split_cache(cache, dim)[1].fill_(SCALE_NAN)
    return cache


def make_case(seq_lens, query_lens, block_size, heads=4, kv_heads=2, dim=16, dtype=torch.float32, seed=0,
              kv_dtype=None, device="cpu"):
    """Fresh random K/V in a NaN-poisoned paged cache, placed through shuffled block tables.

    ``kv_dtype`` (default ``dtype``): the cache's storage dtype; an 8-bit one stores each row quantized, and
    the returned keys/values are then the float64 dequantized rows, what attention must read.
    ``device``: where the metadata, query and caches go (built on the CPU, so every device draws the same
    numbers); the returned keys/values stay on the CPU, for :func:`reference`."""
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = poisoned_cache(num_blocks, block_size, kv_heads, dim, kv_dtype)
    v_cache = poisoned_cache(num_blocks, block_size, kv_heads, dim, kv_dtype)
    tables, keys, values = [], [], []
    for n, nb in zip(seq_lens, needed):
        table = [order.pop() for _ in range(nb)]
        k = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        if is_quantized(kv_dtype):
            packed_k, packed_v = quantize_rows(k, kv_dtype), quantize_rows(v, kv_dtype)
            k, v = dequantize_rows(packed_k, dim, torch.float64), dequantize_rows(packed_v, dim, torch.float64)
        else:
            k, v = packed_k, packed_v = k.to(kv_dtype), v.to(kv_dtype)
        for pos in range(n):
            byte_view(k_cache)[table[pos // block_size], pos % block_size] = byte_view(packed_k[pos])
            byte_view(v_cache)[table[pos // block_size], pos % block_size] = byte_view(packed_v[pos])
        tables.append(table)
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(query_lens), heads, dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(
        block_tables=tables, context_lens=[n - q for n, q in zip(seq_lens, query_lens)],
        query_lens=list(query_lens), block_size=block_size, device=device,
    )
    return meta, query.to(device), k_cache.to(device), v_cache.to(device), keys, values


def nan_scale_case(kv_dtype, dtype=torch.float32, device="cpu"):
    """Two decoding sequences whose first one's newest V row (KV head 0) has the NaN scale code: a kernel that
    decodes code 255 as NaN gives NaN for that sequence's first query-head group and finite values elsewhere
    (a V row: the cpu kernel's exp2 maps a NaN score to 0, so a NaN K row could vanish)."""
    meta, q, k_cache, v_cache, *_ = make_case([9, 20], [1, 1], 16, dim=64, dtype=dtype, kv_dtype=kv_dtype,
                                              device=device)
    slot = int(meta.slot_mapping[0])
    split_cache(v_cache, 64)[1][slot // 16, slot % 16, 0] = SCALE_NAN
    return meta, q, k_cache, v_cache


def assert_nan_scale_read(out):
    assert out[0, :2].isnan().all() and torch.isfinite(out[0, 2:]).all() and torch.isfinite(out[1]).all()
