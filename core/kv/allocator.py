"""Block allocators: how a sequence's table grows as its tokens arrive.

``PagedAllocator`` is the PagedAttention scheme: one block at a time, so waste
is bounded by one partial block per sequence. ``StaticAllocator`` is the naive
baseline that reserves ``max_len`` slots up front, kept so the difference can
be measured on the same workload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.kv.allocator_interface import AllocatorHooks
from pagedkv.core.kv.block_pool import BlockPool

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedAllocator:
    """Grows tables on demand and frees them tail first: the reference
    :class:`~pagedkv.core.kv.allocator_interface.Allocator`.

    ``hooks`` is None when no plugin can make blocks shared: then no write needs a copy-on-write check.
    """

    name = "paged"

    def __init__(self, pool: BlockPool, block_size: int, hooks: AllocatorHooks | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.hooks = hooks
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies this step must run before its forward

    def blocks_to_reserve(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks the table must hold for ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        target = self.blocks_to_reserve(seq, seq.num_computed_tokens + num_new_tokens)
        return max(0, target - len(seq.block_table))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens; all or nothing.

        If the first block to be written is shared (ref count > 1, after a fork),
        a copy-on-write plugin gives the sequence its own copy first.
        """
        fits = seq.num_computed_tokens + num_new_tokens <= len(seq.block_table.blocks) * self.block_size
        if fits and self.hooks is None:
            return True  # the common decode step: the tokens fit in blocks the sequence already has
        new_blocks = self.num_new_blocks(seq, num_new_tokens)
        if self.hooks is None:  # nothing can be shared without plugins: no copy-on-write to check
            if new_blocks > self.pool.num_available:
                return False
            seq.block_table.blocks.extend(self.pool.allocate_many(new_blocks, seq.request_id))
            return True
        shared = self._shared_write_block(seq)
        needed = new_blocks + (shared is not None)
        if needed > self.pool.num_available:
            return False
        if shared is not None:
            copy_on_write = self.hooks.copy_on_write
            done = copy_on_write is not None and copy_on_write(seq=seq, logical_index=shared, allocator=self)
            if not done:
                raise RuntimeError("a shared KV block is about to be written and no copy-on-write plugin handled it")
        for _ in range(new_blocks):
            seq.block_table.append(self.pool.allocate(seq.request_id))
        return True

    def replace_block(self, seq: Sequence, logical_index: int) -> tuple[int, int]:
        """Give ``seq`` a private copy of its block ``logical_index`` (copy-on-write).

        A new block takes the old one's place in the table, the old reference is dropped,
        and the copy ``(old, new)`` is returned and run on the backend before this step's forward.
        """
        old = seq.block_table[logical_index]
        new = self.pool.allocate(seq.request_id)
        seq.block_table.replace(logical_index, new)
        self.pool.decref(old, seq.request_id)
        self._copies.append((old, new))
        self.pool.events.emit("block_cow", src=old, dst=new, owner=seq.request_id)
        return old, new

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies made since the last call (the scheduler puts them in this step's output)."""
        copies, self._copies = self._copies, []
        return copies

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """The logical index of the block the next token lands in, if that block is shared."""
        logical = seq.num_computed_tokens // self.block_size
        if logical < len(seq.block_table) and self.pool.ref_counts[seq.block_table[logical]] > 1:
            return logical
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (ref counts up, nothing copied)."""
        for block_id in parent.block_table:
            self.pool.incref(block_id, child.request_id)
            child.block_table.append(block_id)
        child.num_computed_tokens = parent.num_computed_tokens

    def match_prefix(self, seq: Sequence) -> int:
        """On admission, let a plugin hand over cached blocks; returns tokens skipped."""
        match = self.hooks.match_prefix if self.hooks is not None else None
        if match is None or seq.num_computed_tokens or len(seq.block_table):
            return 0
        if seq.params.prompt_logprobs is not None:  # its prompt logprobs need every prompt position computed
            return 0
        blocks = match(seq=seq, allocator=self)
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
        self.pool.decref_many(reversed(seq.block_table.clear()), seq.request_id)


class StaticAllocator(PagedAllocator):
    """The naive scheme: every request reserves its maximum length when admitted."""

    name = "static"

    def blocks_to_reserve(self, seq: Sequence, num_tokens: int) -> int:
        return cdiv(max(seq.max_len, num_tokens), self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        return 0
