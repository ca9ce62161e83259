"""The pool's free block queue: hand-out order, O(1) removal of a cached block anywhere, and the empty queue.

Each test checks the queue against the order the pool promises (read left to right: cached blocks, most
recently released first, then plain ones; handed out from the right), which a plain list models exactly.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.kv.free_block_queue import FreeBlockQueue


def drained(n: int) -> FreeBlockQueue:
    """A queue of ``n`` blocks with every block handed out."""
    queue = FreeBlockQueue(n)
    assert [queue.pop() for _ in range(n)] == list(range(n))
    return queue


def test_a_fresh_queue_hands_out_0_1_2_and_then_is_empty():
    queue = FreeBlockQueue(4)
    assert list(queue) == [3, 2, 1, 0] and len(queue) == 4 and queue
    assert [queue.pop() for _ in range(4)] == [0, 1, 2, 3]
    assert len(queue) == 0 and not queue and list(queue) == [] and queue.cached_blocks() == []
    with pytest.raises(IndexError):
        queue.pop()


def test_plain_blocks_go_newest_first_and_cached_ones_least_recently_released_first_after_them():
    queue = drained(6)
    for block in (4, 1):
        queue.plain.append(block)
    for block in (0, 5, 2):
        queue.push_cached(block)
    assert list(queue) == [2, 5, 0, 4, 1] and queue.cached_blocks() == [0, 5, 2] and queue.num_cached == 3
    assert [queue.pop() for _ in range(5)] == [1, 4, 0, 5, 2]
    assert not queue and queue.num_cached == 0


@pytest.mark.parametrize("position", ["oldest", "middle", "newest", "only"])
def test_a_cached_block_is_removed_from_either_end_or_the_middle(position):
    queue = drained(5)
    cached = [3] if position == "only" else [3, 0, 4]
    for block in cached:
        queue.push_cached(block)
    queue.plain.append(1)
    target = {"oldest": 3, "middle": 0, "newest": 4, "only": 3}[position]
    queue.remove_cached(target)
    left = [b for b in cached if b != target]
    assert queue.cached_blocks() == left and list(queue) == [*left[::-1], 1] and len(queue) == 1 + len(left)
    assert target not in queue and not queue.is_cached(target)
    assert [queue.pop() for _ in range(len(queue))] == [1, *left]
    with pytest.raises(IndexError):
        queue.pop()


@pytest.mark.parametrize("n", [1, 2, 7])
def test_every_position_can_be_revived_and_the_rest_keep_their_order(n):
    for position in range(n):
        queue = drained(n)
        for block in range(n):
            queue.push_cached(block)
        queue.remove_cached(position)
        assert queue.cached_blocks() == [b for b in range(n) if b != position]
        queue.push_cached(position)  # released again: now the newest, evicted last
        assert queue.cached_blocks() == [*(b for b in range(n) if b != position), position]
        assert [queue.pop() for _ in range(n)] == [*(b for b in range(n) if b != position), position]


def test_removing_a_block_that_is_not_cached_is_an_error_and_changes_nothing():
    queue = drained(3)
    queue.plain.append(2)
    queue.push_cached(0)
    for block in (1, 2):  # handed out, and plain
        with pytest.raises(ValueError, match="not cached"):
            queue.remove_cached(block)
    assert list(queue) == [0, 2] and queue.num_cached == 1
    queue.remove_cached(0)
    with pytest.raises(ValueError, match="not cached"):  # twice
        queue.remove_cached(0)
    assert list(queue) == [2]


def test_random_operations_match_a_list_model():
    rng = random.Random(3)
    n = 40
    queue, model = FreeBlockQueue(n), list(reversed(range(n)))  # model: left to right, popped at the right
    cached: set[int] = set()
    held: list[int] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and model:
            block = queue.pop()
            assert block == model.pop()
            cached.discard(block)
            held.append(block)
        elif op < 0.55 and held:
            block = held.pop(rng.randrange(len(held)))
            queue.plain.append(block)
            model.append(block)
        elif op < 0.8 and held:
            block = held.pop(rng.randrange(len(held)))
            queue.push_cached(block)
            model.insert(0, block)
            cached.add(block)
        elif cached:
            block = rng.choice(sorted(cached))
            queue.remove_cached(block)
            model.remove(block)
            cached.remove(block)
            held.append(block)
        assert list(queue) == model and len(queue) == len(model) and queue.num_cached == len(cached)
        assert queue.cached_blocks() == model[: len(cached)][::-1]


def test_the_pool_revives_any_cached_block_of_a_large_pool_in_place():
    n = 20_000
    pool = BlockPool(n, on_release=lambda b: True)
    blocks = pool.allocate_many(n)
    pool.decref_many(blocks)  # all cached, block 0 released first (evicted first)
    for block in (n - 1, n // 2, 0):  # newest, middle, oldest
        pool.incref(block)
    assert pool.num_cached == n - 3
    order = pool.cached_blocks()
    assert order[:2] == [1, 2] and order[-1] == n - 2 and n // 2 not in order
    pool.decref_many([n // 2])  # released again: the newest cached block
    assert pool.cached_blocks()[-1] == n // 2
    pool.check()
