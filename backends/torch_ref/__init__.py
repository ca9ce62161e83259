"""PyTorch reference backend: runs anywhere torch runs (CPU and CUDA)."""

from __future__ import annotations

import torch

from pagedkv.backends.torch_ref import attention as _ops
from pagedkv.core.kv.attention_metadata import AttentionMetadata


class TorchBackend:
    """The semantic reference for the Triton and CuPy backends."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:  # noqa: ANN001 - see AttentionBackend
        _ops.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return _ops.paged_attention(query, k_cache, v_cache, meta, scale, window, softcap)

    def copy_blocks(self, kv_caches, pairs) -> None:  # noqa: ANN001
        _ops.copy_blocks(kv_caches, pairs)

    def swap_blocks(self, src, dst, pairs) -> None:  # noqa: ANN001
        _ops.swap_blocks(src, dst, pairs)
