"""Paged attention test cases and their float64 reference, shared by every backend's kernel tests."""

from __future__ import annotations

import math

import torch

from pagedkv.core.kv.attention_metadata import AttentionMetadata


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


def make_case(seq_lens, query_lens, block_size, heads=4, kv_heads=2, dim=16, dtype=torch.float32, seed=0):
    """Fresh random K/V in a NaN-poisoned paged cache, placed through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, keys, values = [], [], []
    for n, nb in zip(seq_lens, needed):
        table = [order.pop() for _ in range(nb)]
        k = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
        for pos in range(n):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        tables.append(table)
        keys.append(k)
        values.append(v)
    query = torch.randn(sum(query_lens), heads, dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build(
        block_tables=tables, context_lens=[n - q for n, q in zip(seq_lens, query_lens)],
        query_lens=list(query_lens), block_size=block_size,
    )
    return meta, query, k_cache, v_cache, keys, values
