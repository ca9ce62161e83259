"""The physical KV blocks: ref counts and one free queue whose order is the eviction order.

A block is either owned (ref count > 0) or in the free queue. A free block may
still hold reusable KV (a plugin such as the prefix cache said so when it was
released): it is *cached*, and it stays in the queue, in its place, until it is
handed out for new content (evicted) or shared again (revived by :meth:`incref`).

The queue is handed out from its end. Plain free blocks are added at the end,
so the most recently freed is reused first; cached blocks join at the front,
behind every plain block, so the cache is evicted only when no plain block is
left, least recently released first. The pool knows nothing about sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from pagedkv.core.events import EventLog

KeepBlock = Callable[[int], bool]  # a released block: True if its content stays reusable (cached)
BlockEvicted = Callable[[int], object]  # a cached block is about to be handed out for new content


class OutOfBlocks(RuntimeError):
    """The pool has no free block; the scheduler answers by preempting."""


class BlockPool:
    """``on_release`` and ``on_evict`` connect a cache plugin (the engine wraps its hooks in
    :mod:`pagedkv.core.plugin_guard`, so a raising plugin is disabled instead of breaking the pool)."""

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
        # block id -> True if cached; handed out from the end (popitem), so a fresh pool gives 0, 1, 2, ...
        self.free_queue: OrderedDict[int, bool] = OrderedDict.fromkeys(reversed(range(num_blocks)), False)
        self.num_cached = 0
        self.shared_refs = 0  # references beyond each block's first, summed: 0 when nothing is shared
        self.events = events or EventLog()
        self.on_release = on_release
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Free blocks holding nothing reusable."""
        return len(self.free_queue) - self.num_cached

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: plain free ones and cached ones (evicted on the way)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def cached_blocks(self) -> list[int]:
        """The cached blocks, the next to be evicted first."""
        return [block_id for block_id, cached in reversed(self.free_queue.items()) if cached]

    def is_cached(self, block_id: int) -> bool:
        return self.free_queue.get(block_id, False)

    def allocate(self, owner: str | None = None) -> int:
        """Take the block at the end of the free queue (ref count 1), evicting it if it was cached."""
        if not self.free_queue:
            raise OutOfBlocks("no free KV block")
        block_id, cached = self.free_queue.popitem()
        if cached:
            self.num_cached -= 1
            self.events.emit("block_evict", block=block_id)
            if self.on_evict is not None:
                self.on_evict(block_id)
        self.ref_counts[block_id] = 1
        if self.events.enabled:
            self.events.emit("block_alloc", block=block_id, owner=owner)
        return block_id

    def allocate_many(self, count: int, owner: str | None = None) -> list[int]:
        """``count`` blocks, exactly as ``count`` calls to :meth:`allocate` hand them out.

        The usual case (no cached block among them, no listener) is one loop over
        local names: a static reservation of hundreds of blocks is one call.
        """
        if count > self.num_free or self.events.enabled:
            return [self.allocate(owner) for _ in range(count)]
        pop = self.free_queue.popitem  # no cached block can be among the last `count`: they come after all plain ones
        blocks = [pop()[0] for _ in range(count)]
        refs = self.ref_counts
        for block_id in blocks:
            refs[block_id] = 1
        return blocks

    def incref(self, block_id: int, owner: str | None = None) -> None:
        """Share an owned block, or revive a cached one (it leaves the free queue)."""
        if self.ref_counts[block_id] == 0:
            if not self.free_queue.get(block_id, False):
                raise ValueError(f"block {block_id} is free; it cannot be shared")
            del self.free_queue[block_id]
            self.num_cached -= 1
        else:
            self.shared_refs += 1
        self.ref_counts[block_id] += 1
        self.events.emit("block_share", block=block_id, refs=self.ref_counts[block_id], owner=owner)

    def decref(self, block_id: int, owner: str | None = None) -> None:
        """Drop one reference; see :meth:`decref_many`."""
        self.decref_many((block_id,), owner)

    def decref_many(self, block_ids: Iterable[int], owner: str | None = None) -> None:
        """Drop one reference to each block, in order. A block whose last reference goes back to
        the free queue: cached (at the front) if ``on_release`` says its content stays reusable,
        else plain (at the end)."""
        refs, free, events = self.ref_counts, self.free_queue, self.events
        for block_id in block_ids:
            left = refs[block_id] - 1
            if left > 0:
                refs[block_id] = left
                self.shared_refs -= 1
                if events.enabled:
                    events.emit("block_unshare", block=block_id, refs=left, owner=owner)
            elif left == 0:
                refs[block_id] = 0
                if self.on_release is not None and self.on_release(block_id):
                    free[block_id] = True
                    free.move_to_end(block_id, last=False)
                    self.num_cached += 1
                    events.emit("block_keep", block=block_id)
                else:
                    free[block_id] = False
                    if events.enabled:
                        events.emit("block_free", block=block_id)
            else:
                raise ValueError(f"block {block_id} is already free (double free)")

    def check(self) -> None:
        """Assert the pool's invariants (used by tests and debug runs)."""
        assert self.shared_refs == sum(refs - 1 for refs in self.ref_counts if refs > 1), "shared_refs is off"
        assert self.num_cached == sum(self.free_queue.values()), "num_cached is off"
        cached = self.cached_blocks()
        order = list(reversed(self.free_queue))
        assert order[len(order) - len(cached):] == cached, "a cached block is ahead of a plain free one"
        for block_id, refs in enumerate(self.ref_counts):
            assert refs >= 0
            if refs > 0:
                assert block_id not in self.free_queue, f"block {block_id} owned and free"
            else:
                assert block_id in self.free_queue, f"block {block_id} leaked"
