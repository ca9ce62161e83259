"""CPU swap: preempted sequences park their KV blocks in CPU memory instead of being recomputed.

This plugin is a :class:`~pagedkv.core.kv.swap_space.SwapSpace` (the protocol says who calls what):
it offers itself through ``pagedkv_swap_space`` when ``EngineConfig.swap_space`` gives it room
for at least one block, keeps a CPU block pool of the device cache's layout (pinned memory
on CUDA, allocated only when a real model runner asks for it), and answers
``pagedkv_choose_preemption`` with "swap" while that pool has room, else "recompute". The
scheduler brings swapped sequences back before admitting new requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.kv.kv_cache import KVCacheSpec, allocate_kv_caches

if TYPE_CHECKING:  # type hints only
    import pluggy

    from pagedkv.core.config import EngineConfig
    from pagedkv.core.sched.scheduler_interface import Scheduler
    from pagedkv.core.sched.sequence import Sequence


class CpuSwap:
    def __init__(self, swap_bytes: int) -> None:
        self.swap_bytes = swap_bytes
        self.cpu_pool: BlockPool | None = None
        self.tables: dict[int, list[int]] = {}  # seq.seq_id -> its blocks in the CPU pool, in table order
        self.swap_outs = 0
        self.swap_ins = 0
        self.blocks_moved = 0
        self.bytes_per_block = 0

    @property
    def num_blocks(self) -> int:
        return self.cpu_pool.num_blocks if self.cpu_pool is not None else 0

    # --- hooks ----------------------------------------------------------------------------------------

    @hookimpl
    def pagedkv_swap_space(self, config: EngineConfig, spec: KVCacheSpec) -> CpuSwap | None:
        self.bytes_per_block = spec.bytes_per_block
        num_cpu_blocks = self.swap_bytes // self.bytes_per_block
        if num_cpu_blocks < 1:
            return None  # no room for even one block: every preemption recomputes
        self.cpu_pool = BlockPool(num_cpu_blocks)
        return self

    @hookimpl
    def pagedkv_choose_preemption(self, seq: Sequence, scheduler: Scheduler) -> str:
        if self.cpu_pool is not None and len(seq.block_table) <= self.cpu_pool.num_free:
            return "swap"
        return "recompute"

    @hookimpl
    def pagedkv_report_stats(self) -> dict[str, Any]:
        return {
            "swap_outs": self.swap_outs,
            "swap_ins": self.swap_ins,
            "swap_bytes_moved": self.blocks_moved * self.bytes_per_block,
            "cpu_swap_blocks": self.num_blocks,
        }

    # --- the SwapSpace protocol -----------------------------------------------------------------------

    def swap_out(self, seq: Sequence) -> list[int] | None:
        if self.cpu_pool is None or len(seq.block_table) > self.cpu_pool.num_free:
            return None
        blocks = self.tables[seq.seq_id] = self.cpu_pool.allocate_many(len(seq.block_table), seq.request_id)
        self.swap_outs += 1
        self.blocks_moved += len(blocks)
        return list(blocks)

    def swap_in(self, seq: Sequence) -> list[int]:
        blocks = self.tables.pop(seq.seq_id)
        self.cpu_pool.decref_many(blocks)
        self.swap_ins += 1
        self.blocks_moved += len(blocks)
        return blocks

    def free(self, seq: Sequence) -> None:
        self.cpu_pool.decref_many(self.tables.pop(seq.seq_id, []))

    def blocks_of(self, seq: Sequence) -> list[int]:
        return list(self.tables.get(seq.seq_id, ()))

    def host_kv_caches(self, spec: KVCacheSpec, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        caches = allocate_kv_caches(spec, self.num_blocks, "cpu")
        if device.startswith("cuda"):
            caches = [(k.pin_memory(), v.pin_memory()) for k, v in caches]
        return caches


@hookimpl
def pagedkv_configure(config: EngineConfig, pm: pluggy.PluginManager) -> None:
    if config.swap_space:
        pm.register(CpuSwap(int(config.swap_space)), name="cpu_swap.instance")
