"""The copy-on-write plugin: n samples share their prompt's blocks; a shared partial block is copied on write."""

from __future__ import annotations

import torch
from plugin_helpers import assert_all_blocks_back, plugin, run

from conftest import random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core.kv.allocator import PagedAllocator
from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.sched.sequence import Sequence


def test_forked_samples_equal_independent_seeded_requests(tiny_llama):
    prompt = random_prompts([13], seed=17)[0]  # last block partial at block size 8
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=100, ignore_eos=True)
    plain = Engine(EngineConfig(device="cpu", block_size=8, num_blocks=64), model=tiny_llama)
    independent = run(plain, [prompt], params)[0]
    cow = Engine(EngineConfig(device="cpu", block_size=8, num_blocks=64, enable_copy_on_write=True),
                 model=tiny_llama)
    forked = run(cow, [prompt], params)[0]
    assert [c.token_ids for c in forked.outputs] == [c.token_ids for c in independent.outputs]
    assert len({tuple(c.token_ids) for c in forked.outputs}) > 1
    copies = plugin(cow, "copy_on_write").copies
    assert copies == 3  # the shared partial block, once for each sample but the last holder
    assert cow.stats.peak_blocks_used < plain.stats.peak_blocks_used
    assert_all_blocks_back(cow)


def test_block_aligned_prompt_forks_without_copies(tiny_llama):
    prompt = random_prompts([16], seed=18)[0]
    cow = Engine(EngineConfig(device="cpu", block_size=8, num_blocks=64, enable_copy_on_write=True),
                 model=tiny_llama)
    out = run(cow, [prompt], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [5, 5, 5]
    assert plugin(cow, "copy_on_write").copies == 0
    assert cow.stats.blocks_shared_by_fork == 2 * 2  # two children, each sharing the two prompt blocks
    assert_all_blocks_back(cow)


def test_replace_block_gives_a_private_copy_and_schedules_it():
    pool = BlockPool(8)
    allocator = PagedAllocator(pool, 4)
    parent = Sequence("p", [1] * 6, SamplingParams(), max_len=64)
    child = Sequence("c", [1] * 6, SamplingParams(), max_len=64)
    assert allocator.allocate_slots(parent, 6)
    allocator.fork(parent, child)
    shared = child.block_table[1]
    assert pool.ref_counts[shared] == 2
    old, new = allocator.replace_block(child, 1)
    assert (old, new) == (shared, child.block_table[1]) and new != old
    assert pool.ref_counts[old] == 1 and pool.ref_counts[new] == 1 and parent.block_table[1] == old
    assert allocator.take_copies() == [(old, new)] and allocator.take_copies() == []
    pool.check()


def test_the_copy_reaches_the_step_and_the_backend_copies_the_block(tiny_llama):
    cow = Engine(EngineConfig(device="cpu", block_size=8, num_blocks=32, enable_copy_on_write=True),
                 model=tiny_llama)
    cow.add_request(random_prompts([5], seed=25)[0], SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3))
    copied = []
    execute = cow.runner.execute

    def spy(out):
        for src, dst in out.block_copies:
            copied.append((src, dst))
        result = execute(out)
        for src, dst in out.block_copies:  # the forward ran after the copy: the prompt's KV is in the copy
            for k, v in cow.runner.kv_caches:
                assert torch.equal(k[dst, :5], k[src, :5]) and torch.equal(v[dst, :5], v[src, :5])
        return result

    cow.runner.execute = spy
    run(cow, [], SamplingParams())
    assert len(copied) == 1 and plugin(cow, "copy_on_write").copies == 1
    assert_all_blocks_back(cow)
