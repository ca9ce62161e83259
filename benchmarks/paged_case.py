"""The random paged KV cache the attention benchmarks share: SmolLM2's attention shape, block tables shuffled
over the whole pool (so no two logical neighbours are physical neighbours, as in a long-running engine)."""

from __future__ import annotations

import math

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def random_paged_cache(batch: int, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """``(k_cache, v_cache, block_tables)`` holding ``tokens`` random K/V rows for each of ``batch`` sequences;
    the tables are ``[batch, ceil(tokens / BLOCK)]`` int64."""
    per_seq = math.ceil(tokens / BLOCK)
    num_blocks = batch * per_seq
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    return k_cache, v_cache, torch.randperm(num_blocks, generator=gen).view(batch, per_seq)
