"""KV cache shape, sizing from a byte budget, and allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_model_config(cls, hf_config: Any, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(hf_config.num_hidden_layers, kv_heads, head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        """K and V, every layer: ``2 * layers * block_size * kv_heads * head_dim * dtype_size``."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def blocks_for_bytes(self, budget: int) -> int:
        return budget // self.bytes_per_block


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]
