"""The physical KV blocks: ref counts and a free queue.

Every block is in exactly one state: free (in the queue), owned (ref count > 0)
or kept (ref count 0 but held back by a plugin, e.g. as prefix cache, until it
is reclaimed). The pool knows nothing about sequences.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

from pagedkv.core.events import EventLog


class OutOfBlocks(RuntimeError):
    """The pool has no free block; the scheduler answers by preempting."""


class BlockPool:
    def __init__(self, num_blocks: int, hooks: Any = None, events: EventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue: deque[int] = deque(range(num_blocks))
        self.kept: set[int] = set()
        self.shared_refs = 0  # references beyond each block's first, summed: 0 when nothing is shared
        self.hooks = hooks
        self.events = events or EventLog()

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now: free ones plus kept ones that could be reclaimed."""
        return len(self.free_queue) + len(self.kept)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue) - len(self.kept)

    def allocate(self, owner: str | None = None) -> int:
        """Take a free block (ref count 1), reclaiming kept blocks first if none is free."""
        if not self.free_queue and self.kept and self.hooks is not None:
            self.hooks.pagedkv_reclaim_blocks(pool=self, num_blocks=1)
        if not self.free_queue:
            raise OutOfBlocks("no free KV block")
        block_id = self.free_queue.popleft()
        self.ref_counts[block_id] = 1
        self.events.emit("block_alloc", block=block_id, owner=owner)
        return block_id

    def allocate_many(self, count: int, owner: str | None = None) -> list[int]:
        """``count`` blocks, as ``count`` calls to :meth:`allocate` would hand them out.

        Without hooks or listeners that is a slice of the free queue: a static
        reservation of hundreds of blocks costs one call, not hundreds.
        """
        if self.hooks is not None or self.events.enabled or count > len(self.free_queue):
            return [self.allocate(owner) for _ in range(count)]
        blocks = list(itertools.starmap(self.free_queue.popleft, itertools.repeat((), count)))  # a C-level loop
        refs = self.ref_counts
        for block_id in blocks:
            refs[block_id] = 1
        return blocks

    def incref(self, block_id: int, owner: str | None = None) -> None:
        """Share a block (or revive a kept one)."""
        if self.ref_counts[block_id] == 0:
            if block_id not in self.kept:
                raise ValueError(f"block {block_id} is free; it cannot be shared")
            self.kept.discard(block_id)
        else:
            self.shared_refs += 1
        self.ref_counts[block_id] += 1
        self.events.emit("block_share", block=block_id, refs=self.ref_counts[block_id], owner=owner)

    def decref(self, block_id: int, owner: str | None = None) -> None:
        """Drop one reference; at zero the block is freed unless a plugin keeps it."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is already free (double free)")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] > 0:
            self.shared_refs -= 1
            self.events.emit("block_unshare", block=block_id, refs=self.ref_counts[block_id], owner=owner)
            return
        if self.hooks is not None and self.hooks.pagedkv_on_block_released(block_id=block_id, pool=self):
            self.kept.add(block_id)
            self.events.emit("block_keep", block=block_id)
            return
        self.free_queue.append(block_id)
        self.events.emit("block_free", block=block_id)

    def decref_many(self, block_ids: Iterable[int], owner: str | None = None) -> None:
        """:meth:`decref` each of ``block_ids`` in order; one call when nothing listens."""
        if self.hooks is not None or self.events.enabled:
            for block_id in block_ids:
                self.decref(block_id, owner)
            return
        refs, free = self.ref_counts, self.free_queue.append
        block_ids = list(block_ids)
        if list(map(refs.__getitem__, block_ids)).count(1) == len(block_ids) == len(set(block_ids)):
            for block_id in block_ids:  # the usual case: each is its block's last reference
                refs[block_id] = 0
            self.free_queue.extend(block_ids)
            return
        for block_id in block_ids:
            left = refs[block_id] - 1
            if left < 0:
                raise ValueError(f"block {block_id} is already free (double free)")
            refs[block_id] = left
            if left:
                self.shared_refs -= 1
            else:
                free(block_id)

    def release_kept(self, block_id: int) -> None:
        """Return a kept block to the free queue (a plugin evicting its cache)."""
        self.kept.remove(block_id)
        self.free_queue.append(block_id)
        self.events.emit("block_free", block=block_id)

    def check(self) -> None:
        """Assert the pool's invariants (used by tests and debug runs)."""
        assert self.shared_refs == sum(refs - 1 for refs in self.ref_counts if refs > 1), "shared_refs is off"
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue), "a block is in the free queue twice"
        assert not free & self.kept, "a block is both free and kept"
        for block_id, refs in enumerate(self.ref_counts):
            assert refs >= 0
            if refs > 0:
                assert block_id not in free and block_id not in self.kept, f"block {block_id} owned and free"
            else:
                assert block_id in free or block_id in self.kept, f"block {block_id} leaked"
