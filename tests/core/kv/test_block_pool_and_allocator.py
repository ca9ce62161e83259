"""Block pool ref counting and the paged/static allocators, without a model."""

from __future__ import annotations

import pytest

from pagedkv.core.kv.allocator import PagedAllocator, StaticAllocator
from pagedkv.core.kv.block_pool import BlockPool, OutOfBlocks
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sched.sequence import Sequence


def seq(n_tokens: int, max_len: int = 1000) -> Sequence:
    return Sequence("r", list(range(n_tokens)), SamplingParams(), max_len=max_len)


def test_pool_hands_out_each_block_once_and_takes_it_back():
    pool = BlockPool(3)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate()
    for b in got:
        pool.decref(b)
    assert pool.num_free == 3
    pool.check()


def test_shared_block_is_freed_only_by_its_last_reference():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.incref(b)
    pool.decref(b)
    assert pool.num_free == 1 and pool.ref_counts[b] == 1
    pool.decref(b)
    assert pool.num_free == 2


def test_double_free_and_sharing_a_free_block_are_errors():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.decref(b)
    with pytest.raises(ValueError, match="double free"):
        pool.decref(b)
    with pytest.raises(ValueError, match="free"):
        pool.incref(b)


def test_paged_allocator_grows_one_block_at_a_time():
    pool = BlockPool(10)
    alloc = PagedAllocator(pool, block_size=4)
    s = seq(5)
    assert alloc.allocate_slots(s, 5)
    assert len(s.block_table) == 2  # 5 tokens -> 2 blocks of 4
    s.num_computed_tokens = 5
    for expected_blocks, n in [(2, 6), (2, 7), (2, 8), (3, 9)]:
        assert alloc.allocate_slots(s, 1)
        s.num_computed_tokens = n
        assert len(s.block_table) == expected_blocks
    alloc.free(s)
    assert pool.num_free == 10 and len(s.block_table) == 0


def test_allocation_is_all_or_nothing():
    pool = BlockPool(2)
    alloc = PagedAllocator(pool, block_size=4)
    s = seq(12)
    assert not alloc.allocate_slots(s, 12)  # needs 3 blocks
    assert len(s.block_table) == 0 and pool.num_free == 2


def test_free_returns_tail_blocks_first():
    pool = BlockPool(4)
    alloc = PagedAllocator(pool, block_size=1)
    s = seq(3)
    alloc.allocate_slots(s, 3)
    table = list(s.block_table)
    alloc.free(s)
    assert list(pool.free_queue)[-3:] == table[::-1]


def test_static_allocator_reserves_max_len_up_front():
    pool = BlockPool(40)
    alloc = StaticAllocator(pool, block_size=4)
    s = seq(3, max_len=64)
    assert alloc.allocate_slots(s, 3)
    assert len(s.block_table) == 16
    s.num_computed_tokens = 3
    assert alloc.num_new_blocks(s, 1) == 0  # growth needs nothing new


def test_block_table_maps_positions_to_slots():
    from pagedkv.core.kv.block_table import BlockTable

    table = BlockTable([7, 2])
    assert table.slot(0, 4) == 28 and table.slot(5, 4) == 9
    assert table.capacity(4) == 8


def _cache_pool(num_blocks, cacheable):
    evicted = []
    pool = BlockPool(num_blocks, on_release=lambda b: b in cacheable, on_evict=evicted.append)
    return pool, evicted


def test_the_free_queue_hands_out_plain_blocks_first_then_cached_ones_least_recently_released_first():
    pool, evicted = _cache_pool(6, cacheable={0, 1, 2})
    taken = [pool.allocate() for _ in range(6)]
    assert taken == [0, 1, 2, 3, 4, 5]
    pool.decref_many([1, 3, 0, 4, 2])  # cached: 1, 0, 2 in that order; plain: 3, 4
    assert pool.num_cached == 3 and pool.num_free == 2 and pool.num_available == 5 and pool.num_used == 1
    assert pool.cached_blocks() == [1, 0, 2]
    pool.check()
    assert [pool.allocate() for _ in range(5)] == [4, 3, 1, 0, 2]  # newest plain first; then LRU cached
    assert evicted == [1, 0, 2] and pool.num_cached == 0
    pool.check()


def test_a_cached_block_is_revived_by_incref_and_leaves_the_free_queue():
    pool, evicted = _cache_pool(4, cacheable={0, 1})
    a, b = pool.allocate(), pool.allocate()
    pool.decref_many([a, b])
    pool.incref(b, "next")
    assert pool.ref_counts[b] == 1 and pool.cached_blocks() == [a] and pool.shared_refs == 0
    assert b not in pool.free_queue
    pool.check()
    assert [pool.allocate() for _ in range(3)] == [2, 3, a] and evicted == [a]
    with pytest.raises(ValueError, match="cannot be shared"):
        BlockPool(2).incref(1)  # a plain free block holds nothing to share


@pytest.mark.parametrize("cacheable", [set(), {1, 4, 6}])
def test_batch_calls_hand_out_and_take_back_exactly_as_single_calls(cacheable):
    import random

    rng = random.Random(7)
    single, _ = _cache_pool(12, cacheable)
    batch, _ = _cache_pool(12, cacheable)
    held_single, held_batch = [], []
    for _ in range(30):
        if held_single and rng.random() < 0.5:
            k = rng.randrange(1, len(held_single) + 1)
            freed = held_single[:k]
            for block_id in freed:
                single.decref(block_id)
            batch.decref_many(held_batch[:k])
            del held_single[:k], held_batch[:k]
        else:
            n = rng.randrange(0, single.num_available + 1)
            held_single += [single.allocate() for _ in range(n)]
            held_batch += batch.allocate_many(n)
        assert held_single == held_batch and list(single.free_queue) == list(batch.free_queue)
        assert single.cached_blocks() == batch.cached_blocks()
        single.check()
        batch.check()


def test_shared_references_are_counted_and_a_double_free_in_a_batch_is_an_error():
    pool = BlockPool(3)
    a = pool.allocate()
    pool.incref(a)
    pool.incref(a)
    assert pool.shared_refs == 2
    pool.decref_many([a, a])
    assert pool.ref_counts[a] == 1 and pool.shared_refs == 0 and pool.num_free == 2
    with pytest.raises(ValueError, match="double free"):
        pool.decref_many([a, a])
