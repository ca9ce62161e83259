"""CPU swap: preempted sequences park their KV blocks in CPU memory instead of being recomputed.

The CPU pool has the device cache's layout (pinned memory on CUDA). When the
scheduler must preempt, this plugin answers "swap" if the CPU pool has room,
else "recompute". Swapped sequences come back before new requests are
admitted; the copies run in batches, once per step, through the backend.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.kv_cache import allocate_kv_caches


class CpuSwap:
    def __init__(self, swap_bytes: int) -> None:
        self.swap_bytes = swap_bytes
        self.cpu_pool: BlockPool | None = None
        self.allocator: Any = None
        self.cpu_blocks: dict[int, list[int]] = {}  # seq.seq_id -> its blocks in the CPU pool, in table order
        self.swap_outs = 0
        self.swap_ins = 0
        self.blocks_moved = 0
        self.bytes_per_block = 0

    @hookimpl
    def pagedkv_engine_started(self, engine: Any) -> None:
        self.bytes_per_block = engine.spec.bytes_per_block
        num_cpu_blocks = self.swap_bytes // self.bytes_per_block
        self.allocator = engine.allocator
        if num_cpu_blocks < 1:
            return  # no room for even one block: every preemption recomputes
        self.cpu_pool = BlockPool(num_cpu_blocks)
        engine.scheduler.swapper = self
        if not engine.runner.kv_caches:  # a simulated run moves no bytes: book-keeping only
            return
        caches = allocate_kv_caches(engine.spec, num_cpu_blocks, "cpu")
        if engine.config.device.startswith("cuda"):
            caches = [(k.pin_memory(), v.pin_memory()) for k, v in caches]
        engine.runner.cpu_kv_caches = caches

    @hookimpl
    def pagedkv_choose_preemption(self, seq: Any, scheduler: Any) -> str:
        if self.cpu_pool is not None and len(seq.block_table) <= self.cpu_pool.num_free:
            return "swap"
        return "recompute"

    def swap_out(self, seq: Any) -> list[tuple[int, int]] | None:
        """Reserve CPU blocks, free the device blocks; returns (device, cpu) pairs to copy this step."""
        if self.cpu_pool is None or len(seq.block_table) > self.cpu_pool.num_free:
            return None
        pairs = [(block, self.cpu_pool.allocate(seq.request_id)) for block in seq.block_table]
        self.cpu_blocks[seq.seq_id] = [cpu for _, cpu in pairs]
        for block, cpu in pairs:
            self.allocator.pool.events.emit("block_swap_out", block=block, cpu_block=cpu, owner=seq.request_id)
        self.allocator.free(seq)
        self.swap_outs += 1
        self.blocks_moved += len(pairs)
        return pairs

    def swap_in(self, seq: Any) -> list[tuple[int, int]]:
        """Give the sequence fresh device blocks; returns (cpu, device) pairs to copy this step."""
        pairs = []
        for cpu in self.cpu_blocks.pop(seq.seq_id):
            block = self.allocator.pool.allocate(seq.request_id)
            seq.block_table.append(block)
            pairs.append((cpu, block))
            self.cpu_pool.decref(cpu)
            self.allocator.pool.events.emit("block_swap_in", block=block, cpu_block=cpu, owner=seq.request_id)
        self.swap_ins += 1
        self.blocks_moved += len(pairs)
        return pairs

    def free(self, seq: Any) -> None:
        """A swapped sequence was aborted: give back its CPU blocks."""
        for cpu in self.cpu_blocks.pop(seq.seq_id, []):
            self.cpu_pool.decref(cpu)

    @hookimpl
    def pagedkv_report_stats(self) -> dict[str, Any]:
        return {
            "swap_outs": self.swap_outs,
            "swap_ins": self.swap_ins,
            "swap_bytes_moved": self.blocks_moved * self.bytes_per_block,
            "cpu_swap_blocks": self.cpu_pool.num_blocks if self.cpu_pool else 0,
        }


@hookimpl
def pagedkv_configure(config: Any, pm: Any) -> None:
    if config.swap_space:
        pm.register(CpuSwap(int(config.swap_space)), name="cpu_swap.instance")
