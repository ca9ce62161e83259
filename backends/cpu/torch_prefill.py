"""Prefill sequences of a step through torch's SDPA, one sequence at a time, for builds of the kernel whose
prefill path is slower than torch's on this CPU (see ``routes.py``).

One call per sequence rather than the reference's one padded call: in a step that mixes decodes with a
prefill chunk the reference pads every sequence to the longest query, which would multiply the decodes'
work by the chunk length. A sequence without cached context and without a window takes SDPA's causal
path (no mask tensor at all); the others get a boolean mask, built once per step and kept for every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.backends.torch_ref.attention import attention_math
from pagedkv.core.kv.attention_metadata import AttentionMetadata

PlanRow = tuple[int, int, int, torch.Tensor, "torch.Tensor | None"]


def prefill_plan(meta: AttentionMetadata, window: int | None) -> list[PlanRow]:
    """(first query row, query length, sequence length, block ids, mask or None) of each multi-token sequence."""
    key = f"cpu.torch_prefill.{window}"
    plan = meta.backend_cache.get(key)
    if plan is not None:
        return plan
    plan = []
    start = 0
    tables = meta.block_tables.to("cpu", torch.int64)
    q_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if len(q_lens) != meta.num_seqs or len(seq_lens) != meta.num_seqs:  # (metadata built without host copies)
        q_lens = tuple(meta.query_start_loc.diff().tolist())
        seq_lens = tuple(meta.seq_lens.tolist())
    for i, (q_len, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        if q_len > 1:
            blocks = tables[i, : -(-n // meta.block_size)]
            mask = None
            if n != q_len or window is not None:
                q_pos = torch.arange(n - q_len, n)[:, None]
                k_pos = torch.arange(n)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            plan.append((start, q_len, n, blocks, mask))
        start += q_len
    meta.backend_cache[key] = plan
    return plan


def attend_prefills(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> None:
    """Write the output rows of every sequence with more than one query token into ``out`` ``[T, H, D]``."""
    heads, kv_heads, dim = query.shape[1], k_cache.shape[2], k_cache.shape[3]
    gqa = heads != kv_heads
    for start, q_len, n, blocks, mask in prefill_plan(meta, window):
        k = k_cache.index_select(0, blocks).view(-1, kv_heads, dim)[:n].transpose(0, 1)[None].float()
        v = v_cache.index_select(0, blocks).view(-1, kv_heads, dim)[:n].transpose(0, 1)[None].float()
        q = query[start : start + q_len].transpose(0, 1)[None].float()
        if softcap is not None:
            o = attention_math(q, k, v, mask if mask is not None else _causal(q_len), scale, softcap)
        elif mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + q_len] = o[0].transpose(0, 1)


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()
