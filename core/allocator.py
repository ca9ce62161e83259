"""Block allocators: how a sequence's table grows as its tokens arrive.

``PagedAllocator`` is the PagedAttention scheme: one block at a time, so waste
is bounded by one partial block per sequence. ``StaticAllocator`` is the naive
baseline that reserves ``max_len`` slots up front, kept so the difference can
be measured on the same workload.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedAllocator:
    """Grows tables on demand and frees them tail first."""

    name = "paged"

    def __init__(self, pool: BlockPool, block_size: int, hooks: Any = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hooks = hooks

    def blocks_to_reserve(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks the table must hold for ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        target = self.blocks_to_reserve(seq, seq.num_computed_tokens + num_new_tokens)
        return max(0, target - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.pool.num_available

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens; all or nothing."""
        needed = self.num_new_blocks(seq, num_new_tokens)
        if needed > self.pool.num_available:
            return False
        for _ in range(needed):
            seq.block_table.append(self.pool.allocate(seq.request_id))
        return True

    def match_prefix(self, seq: Sequence) -> int:
        """On admission, let a plugin hand over cached blocks; returns tokens skipped."""
        if self.hooks is None or seq.num_computed_tokens or len(seq.block_table):
            return 0
        blocks = self.hooks.pagedkv_match_prefix(seq=seq, allocator=self)
        if not blocks:
            return 0
        max_blocks = (seq.num_tokens - 1) // self.block_size  # always compute the last token
        blocks = blocks[:max_blocks]
        for block_id in blocks:
            self.pool.incref(block_id, seq.request_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(blocks) * self.block_size
        return seq.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Give back every reference the sequence holds, tail block first."""
        for block_id in reversed(seq.block_table.clear()):
            self.pool.decref(block_id, seq.request_id)


class StaticAllocator(PagedAllocator):
    """The naive scheme: every request reserves its maximum length when admitted."""

    name = "static"

    def blocks_to_reserve(self, seq: Sequence, num_tokens: int) -> int:
        return cdiv(max(seq.max_len, num_tokens), self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        return 0
