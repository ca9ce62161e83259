"""Checks the engine makes before it builds something big or slow, so a bad setting costs one clear line.

A backend is started before the model loads (a CUDA-only backend on a CPU
machine is refused in a second, not after a long load), and the KV cache's
size is checked against the block cap and, for host memory, against what the
machine has available.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.config import EngineConfig
from pagedkv.core.errors import ConfigError, PagedKVError
from pagedkv.core.kv.kv_cache import KVCacheSpec, decide_max_model_len, decide_num_blocks
from pagedkv.core.limits import check_cap, check_host_memory
from pagedkv.core.plugin.plugin_manager import Entry


def start_backend(entry: Entry, config: EngineConfig) -> Any:
    """Build the attention backend; any failure is a :class:`ConfigError` naming it."""
    try:
        return entry.factory(config)
    except PagedKVError:
        raise
    except Exception as exc:  # noqa: BLE001 - a backend (maybe a third party's) may fail in any way
        raise ConfigError(f"backend {config.backend!r} cannot start: {exc}") from exc


def check_kv_size(num_blocks: int, bytes_per_block: int, config: EngineConfig, allocates: bool) -> int:
    """``num_blocks`` if the pool may have that many blocks and, when ``allocates``, its host memory fits."""
    if allocates and str(config.device).startswith("cuda"):
        check_device_memory(num_blocks * bytes_per_block, config.device, f"the KV cache ({num_blocks:,} blocks)")
    if allocates:
        on_host = num_blocks * bytes_per_block if str(config.device).startswith("cpu") else 0
        swap = int(getattr(config, "swap_space", 0) or 0)  # the CPU swap pool lives in host memory everywhere
        if on_host or swap:
            what = "the KV cache" if not swap else ("the KV cache plus swap space" if on_host else "the swap space")
            check_host_memory(on_host + swap, f"{what} ({num_blocks:,} blocks)" if on_host else what)
    check_cap("blocks", num_blocks, "the KV cache's number of blocks")  # after memory: the likelier reason
    swap_blocks = int(getattr(config, "swap_space", 0) or 0) // max(1, bytes_per_block)
    check_cap("blocks", swap_blocks, "the swap space's number of blocks")  # its pool has one entry per block
    return num_blocks


def check_device_memory(nbytes: int, device: str, what: str) -> None:
    """Refuse a CUDA allocation larger than the device's free memory now (instead of an out-of-memory traceback)."""
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    if nbytes > free:
        raise ConfigError(
            f"{what} needs {nbytes / 2**30:,.2f} GiB on {device} but only {free / 2**30:,.2f} GiB is free; "
            "give a smaller kv_cache_memory / num_blocks or a lower gpu_memory_utilization"
        )


def size_kv_cache(config: EngineConfig, hf_config: Any, model: Any, allocates: bool) -> tuple[KVCacheSpec, int, int]:
    """(per-rank spec, number of blocks, max_model_len) for ``config`` on this model; ``allocates``: the cache
    will really be allocated (its size is checked against the memory there is)."""
    spec = KVCacheSpec.from_model_config(hf_config, config.block_size, config.kv_dtype)
    if config.tensor_parallel_size > 1 and allocates:  # each rank holds its share of the KV heads
        from pagedkv.core.dist.tensor_parallel import check_divisible, rank_spec

        check_divisible(hf_config, config.tensor_parallel_size)
        spec = rank_spec(spec, config.tensor_parallel_size)
    num_blocks = check_kv_size(decide_num_blocks(config, spec, model), spec.bytes_per_block, config, allocates)
    return spec, num_blocks, decide_max_model_len(config, hf_config, num_blocks * config.block_size)
