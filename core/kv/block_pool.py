"""The physical KV blocks: ref counts and one free queue whose order is the eviction order.

A block is either owned (ref count > 0) or in the free queue. A free block may
still hold reusable KV (a plugin such as the prefix cache said so when it was
released): it is *cached*, and it stays in the queue, in its place, until it is
handed out for new content (evicted) or shared again (revived by :meth:`incref`).

The queue is handed out from its right end. Plain free blocks join at the
right, so the most recently freed is reused first; cached blocks join at the
left, behind every plain block, so the cache is evicted only when no plain
block is left, least recently released first. Reviving a cached block takes it
out of the queue in constant time (:class:`~pagedkv.core.kv.free_block_queue.FreeBlockQueue`).
The pool knows nothing about sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedkv.core.events import EventLog
from pagedkv.core.kv.free_block_queue import FreeBlockQueue

KeepBlock = Callable[[int], bool]  # a released block: True if its content stays reusable (cached)
BlockEvicted = Callable[[int], object]  # a cached block is about to be handed out for new content


class OutOfBlocks(RuntimeError):
    """The pool has no free block; the scheduler answers by preempting."""


class BlockPool:
    """``on_release`` and ``on_evict`` connect a cache plugin (the engine wraps its hooks in
    :mod:`pagedkv.core.plugin.plugin_guard`, so a raising plugin is disabled instead of breaking the pool)."""

    def __init__(
        self,
        num_blocks: int,
        events: EventLog | None = None,
        *,
        on_release: KeepBlock | None = None,
        on_evict: BlockEvicted | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue = FreeBlockQueue(num_blocks)  # a fresh pool hands out 0, 1, 2, ...
        self._plain = self.free_queue.plain  # its plain blocks (the hot path's, one lookup away)
        self.shared_refs = 0  # references beyond each block's first, summed: 0 when nothing is shared
        self.events = events or EventLog()
        self.on_release = on_release
        self.on_evict = on_evict

    @property
    def num_cached(self) -> int:
        """Free blocks whose content stays reusable."""
        return self.free_queue.num_cached

    @property
    def num_free(self) -> int:
        """Free blocks holding nothing reusable."""
        return len(self._plain)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: plain free ones and cached ones (evicted on the way)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def cached_blocks(self) -> list[int]:
        """The cached blocks, the next to be evicted first."""
        return self.free_queue.cached_blocks()

    def allocate(self, owner: str | None = None) -> int:
        """Take the block at the right end of the free queue (ref count 1), evicting it if it was cached."""
        plain = self._plain
        if plain:
            block_id = plain.pop()
        elif self.free_queue:
            block_id = self.free_queue.pop()  # the least recently released cached block
            self.events.emit("block_evict", block=block_id)
            if self.on_evict is not None:
                self.on_evict(block_id)
        else:
            raise OutOfBlocks("no free KV block")
        self.ref_counts[block_id] = 1
        if self.events.enabled:
            self.events.emit("block_alloc", block=block_id, owner=owner)
        return block_id

    def allocate_many(self, count: int, owner: str | None = None) -> list[int]:
        """``count`` blocks, exactly as ``count`` calls to :meth:`allocate` hand them out.

        The usual case (no cached block among them, no listener) is one loop over
        local names: a static reservation of hundreds of blocks is one call.
        """
        plain = self._plain
        if count > len(plain) or self.events.enabled:
            return [self.allocate(owner) for _ in range(count)]
        pop = plain.pop  # (no cached block among the first `count`: they all come after the plain ones)
        blocks = [pop() for _ in range(count)]
        refs = self.ref_counts
        for block_id in blocks:
            refs[block_id] = 1
        return blocks

    def incref(self, block_id: int, owner: str | None = None) -> None:
        """Share an owned block, or revive a cached one (it leaves the free queue)."""
        if self.ref_counts[block_id] == 0:
            if not self.free_queue.is_cached(block_id):
                raise ValueError(f"block {block_id} is free; it cannot be shared")
            self.free_queue.remove_cached(block_id)
        else:
            self.shared_refs += 1
        self.ref_counts[block_id] += 1
        self.events.emit("block_share", block=block_id, refs=self.ref_counts[block_id], owner=owner)

    def decref(self, block_id: int, owner: str | None = None) -> None:
        """Drop one reference; see :meth:`decref_many`."""
        self.decref_many((block_id,), owner)

    def decref_many(self, block_ids: Iterable[int], owner: str | None = None) -> None:
        """Drop one reference to each block, in order. A block whose last reference goes joins the
        free queue: cached (at the left, behind every plain block) if ``on_release`` says its
        content stays reusable, else plain (at the right: reused first)."""
        refs, events, keep = self.ref_counts, self.events, self.on_release
        free, listening = self._plain.append, events.enabled
        for block_id in block_ids:
            left = refs[block_id] - 1
            if left == 0:
                refs[block_id] = 0
                if keep is not None and keep(block_id):
                    self.free_queue.push_cached(block_id)
                    events.emit("block_keep", block=block_id)
                else:
                    free(block_id)
                    if listening:
                        events.emit("block_free", block=block_id)
            elif left > 0:
                refs[block_id] = left
                self.shared_refs -= 1
                if listening:
                    events.emit("block_unshare", block=block_id, refs=left, owner=owner)
            else:
                raise ValueError(f"block {block_id} is already free (double free)")

    def check(self) -> None:
        """Assert the pool's invariants (used by tests and debug runs)."""
        assert self.shared_refs == sum(refs - 1 for refs in self.ref_counts if refs > 1), "shared_refs is off"
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is in the free queue twice"
        cached = self.cached_blocks()
        assert len(cached) == self.num_cached and all(self.free_queue.is_cached(b) for b in cached), "cache is off"
        assert list(self.free_queue)[: len(cached)] == cached[::-1], "a cached block is ahead of a plain free one"
        for block_id, refs in enumerate(self.ref_counts):
            assert refs >= 0
            if refs > 0:
                assert block_id not in free, f"block {block_id} owned and free"
            else:
                assert block_id in free, f"block {block_id} leaked"
