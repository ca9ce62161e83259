"""KV cache shape, sizing (blocks from a byte budget or GPU profiling, max_model_len), and allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.core.config import EngineConfig
from pagedkv.core.errors import ConfigError
from pagedkv.core.kv.kv_dtype import kv_dtype_name, row_width


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # the storage dtype (``core/kv/kv_dtype.py``): the model's, a cast, or an 8-bit format

    @classmethod
    def from_model_config(cls, hf_config: Any, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(hf_config.num_hidden_layers, kv_heads, head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        """K and V, every layer: ``2 * layers * block_size * kv_heads * row * dtype_size``, where a row is
        ``head_dim`` values plus, for an 8-bit cache, its 1-byte scale."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row_width * itemsize

    @property
    def row_width(self) -> int:
        """Elements of one (token, KV head) row in the cache tensors."""
        return row_width(self.head_dim, self.dtype)

    def blocks_for_bytes(self, budget: int) -> int:
        return budget // self.bytes_per_block


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, row_width]`` (``head_dim``,
    plus the scale of an 8-bit cache).

    Not zeroed: nothing reads a slot before a step writes it (attention reads only each sequence's first
    ``context_len`` slots, and the kernel tests poison every other slot with NaN; swaps and copy-on-write copy
    whole blocks, garbage included, into slots that are again unread). Zeroing the default 1 GiB was a
    start-up phase of its own (seconds on a busy machine); untouched pages also cost no memory until used.
    ``tests/core/kv/test_kv_garbage.py`` runs whole engines on a NaN-filled cache."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
    return [
        (torch.empty(shape, dtype=spec.dtype, device=device), torch.empty(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]


def capacity_line(
    num_blocks: int, spec: KVCacheSpec, max_model_len: int, world_size: int = 1, kv_cache_dtype: str = "auto"
) -> str:
    """The KV budget in plain words: how many requests of the longest allowed length fit at once (and the
    KV dtype, when ``--kv-cache-dtype`` chose one)."""
    tokens = num_blocks * spec.block_size
    size = num_blocks * spec.bytes_per_block
    size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    if kv_cache_dtype != "auto":
        size_text += f" of {kv_dtype_name(spec.dtype)}"
    fits = tokens // max_model_len
    line = (f"KV cache: {num_blocks} blocks of {spec.block_size} tokens = {tokens} tokens ({size_text}); room for "
            f"about {fits} request{'s' if fits != 1 else ''} of {max_model_len} tokens at once")
    if max_model_len > 1024:
        line += f", or {tokens // 1024} of 1024 tokens"
    return line + tensor_parallel_note(world_size, spec, num_blocks)


def tensor_parallel_note(world_size: int, spec: KVCacheSpec, num_blocks: int) -> str:
    """The capacity line's tail under tensor parallelism: the KV bytes per rank and in total."""
    if world_size <= 1:
        return ""
    per_rank = num_blocks * spec.bytes_per_block
    return (
        f"; tensor parallel over {world_size} ranks, {spec.num_kv_heads} KV heads each: "
        f"{per_rank / 2**20:.1f} MiB per rank, {world_size * per_rank / 2**20:.1f} MiB in total"
    )


# --- sizing: how many blocks, how long a request may be -------------------------------------------------------

DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_GPU_UTILIZATION = 0.9


def decide_num_blocks(config: EngineConfig, spec: KVCacheSpec, model: Any = None) -> int:
    """Blocks for the configured budget: ``num_blocks``, else ``kv_cache_memory``, else (CUDA) what the
    GPU has left after the model's largest step, else 1 GiB on CPU. Under tensor parallelism ``spec`` is one
    rank's share, so a byte budget is per rank (as in vLLM) and buys N times the blocks."""
    if config.num_blocks is not None:
        return config.num_blocks
    if config.kv_cache_memory is not None:
        budget = int(config.kv_cache_memory)
    elif config.device.startswith("cuda") and model is not None:
        budget = profile_gpu_budget(model, config, config.gpu_memory_utilization or DEFAULT_GPU_UTILIZATION)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    blocks = budget // spec.bytes_per_block
    if blocks < 1:
        raise ConfigError(
            f"the KV budget ({budget} bytes) is below one block ({spec.bytes_per_block} bytes at block_size "
            f"{config.block_size}); give a larger kv_cache_memory or a smaller block_size"
        )
    return blocks


def profile_gpu_budget(model: Any, config: EngineConfig, utilization: float) -> int:
    """vLLM's way: run the largest step once, then give the KV cache what is left."""
    device = torch.device(config.device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    tokens = min(config.max_num_batched_tokens, 2048)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, tokens), dtype=torch.long, device=device), use_cache=False)
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * utilization) - peak


def decide_max_model_len(config: EngineConfig, hf_config: Any, capacity_tokens: int) -> int:
    """The configured or the model's limit, never more than the whole cache holds.

    An explicit ``max_model_len`` the cache cannot hold for one request is an error (as vLLM refuses to
    start); ``"auto"`` takes what the cache holds; unset takes the model's limit, capped by the cache.
    """
    model_limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    wanted = config.max_model_len
    if wanted == "auto":
        return min(model_limit or capacity_tokens, capacity_tokens)
    if wanted is not None and model_limit is not None and wanted > model_limit:
        raise ConfigError(f"max_model_len {wanted} is above the model's limit of {model_limit} positions")
    if wanted is not None and wanted > capacity_tokens:
        raise ConfigError(
            f"max_model_len {wanted} does not fit: the KV cache holds {capacity_tokens} tokens "
            f"({capacity_tokens // config.block_size} blocks of {config.block_size}), less than one request that "
            "long; give a larger --kv-cache-memory / --num-blocks, a smaller --max-model-len, or --max-model-len auto"
        )
    return min(wanted or model_limit or capacity_tokens, capacity_tokens)

