"""Block pool ref counting and the paged/static allocators, without a model."""

from __future__ import annotations

import pytest

from pagedkv.core.allocator import PagedAllocator, StaticAllocator
from pagedkv.core.block_pool import BlockPool, OutOfBlocks
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.core.sequence import Sequence


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
    from pagedkv.core.block_table import BlockTable

    table = BlockTable([7, 2])
    assert table.slot(0, 4) == 28 and table.slot(5, 4) == 9
    assert table.capacity(4) == 8
