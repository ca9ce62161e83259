"""The free blocks in hand-out order, with O(1) removal of any cached block.

Read left to right, the queue is every cached block, most recently released first, then every
plain free block, most recently freed last; it is handed out from the right. So plain blocks go
first, newest first (their memory is the likeliest to be warm), and the cache is evicted only
when no plain block is left, least recently released first.

Plain blocks only ever come and go at the right end: they are a stack (a deque, as the whole queue was). Cached
blocks join at the left and leave at their segment's right end (evicted) or from anywhere
(revived, when a request shares one again): they are a doubly linked list threaded through two
arrays indexed by block id, so a revival costs the same in a pool of a million blocks as in one
of a thousand (a scan of the queue would cost a pass over every free block).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

_OUT = -1  # the link of a block that is not in the cached list


class FreeBlockQueue:
    """Free block ids of a pool of ``num_blocks``; a fresh queue hands out 0, 1, 2, ..."""

    def __init__(self, num_blocks: int) -> None:
        self.plain: deque[int] = deque(reversed(range(num_blocks)))  # handed out from its right end
        # the cached list: node ``num_blocks`` is its sentinel, whose right link is the leftmost
        # cached block (the newest) and whose left link the rightmost (the next to be evicted)
        self._end = num_blocks
        self._left = [_OUT] * (num_blocks + 1)
        self._right = [_OUT] * (num_blocks + 1)
        self._left[num_blocks] = self._right[num_blocks] = num_blocks
        self.num_cached = 0

    def __len__(self) -> int:
        return len(self.plain) + self.num_cached

    def __bool__(self) -> bool:
        return bool(self.plain) or self.num_cached > 0

    def __iter__(self) -> Iterator[int]:
        """Left to right: the cached blocks, newest first, then the plain ones, the next handed out last."""
        right, end = self._right, self._end
        block = right[end]
        while block != end:
            yield block
            block = right[block]
        yield from self.plain

    def __contains__(self, block_id: int) -> bool:
        return self.is_cached(block_id) or block_id in self.plain  # (the plain check scans: tests and checks only)

    def is_cached(self, block_id: int) -> bool:
        return self._right[block_id] != _OUT

    def cached_blocks(self) -> list[int]:
        """The cached blocks, the next to be evicted first."""
        left, end = self._left, self._end
        blocks, block = [], left[end]
        while block != end:
            blocks.append(block)
            block = left[block]
        return blocks

    def push_cached(self, block_id: int) -> None:
        """A released block whose content stays reusable joins at the left: evicted after every other."""
        left, right, end = self._left, self._right, self._end
        newest = right[end]
        left[block_id], right[block_id] = end, newest
        left[newest] = right[end] = block_id
        self.num_cached += 1

    def pop(self) -> int:
        """Take the block at the right end: the newest plain block, else the oldest cached one (evicted)."""
        if self.plain:
            return self.plain.pop()
        oldest = self._left[self._end]
        if oldest == self._end:
            raise IndexError("pop from an empty free block queue")
        self.remove_cached(oldest)
        return oldest

    def remove_cached(self, block_id: int) -> None:
        """Take a cached block out of the queue, wherever it is (O(1))."""
        left, right = self._left, self._right
        before, after = left[block_id], right[block_id]
        if after == _OUT:
            raise ValueError(f"block {block_id} is not cached in the free queue")
        right[before], left[after] = after, before
        left[block_id] = right[block_id] = _OUT
        self.num_cached -= 1
