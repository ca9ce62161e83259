"""The prefix-cache plugin: shared prompt heads are computed once; cached blocks wait in the pool's free queue."""

from __future__ import annotations

import pytest
from plugin_helpers import GREEDY, assert_all_blocks_back, plugin, run

from conftest import hf_greedy, random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams


def cache_engine(tiny_llama, num_blocks, block_size=8):
    config = EngineConfig(device="cpu", block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=True)
    return Engine(config, model=tiny_llama)


def test_shared_prefix_is_computed_once_and_outputs_match_transformers(tiny_llama):
    system = random_prompts([40], seed=11)[0]
    prompts = [system + tail for tail in random_prompts([5, 9, 3], seed=12)]
    expected = [hf_greedy(tiny_llama, p, 12) for p in prompts]
    engine = cache_engine(tiny_llama, 64)
    first = run(engine, prompts[:1], GREEDY)
    rest = run(engine, prompts[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == expected
    stats = plugin(engine, "prefix_cache").pagedkv_report_stats()
    assert stats["prefix_hit_tokens"] == 2 * 40  # five full blocks of the system prompt, for two requests
    assert engine.stats.prefill_tokens_computed == sum(map(len, prompts)) - 2 * 40
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("case", ["identical", "strict_prefix", "block_aligned"])
def test_fully_cached_prompts_still_compute_their_last_token(tiny_llama, case):
    base = random_prompts([24], seed=13)[0]
    second = {"identical": base, "strict_prefix": base[:17], "block_aligned": base[:16]}[case]
    expected = [hf_greedy(tiny_llama, p, 12) for p in (base, second)]
    engine = cache_engine(tiny_llama, 32)
    outs = run(engine, [base], GREEDY) + run(engine, [second], GREEDY)
    assert [o.token_ids for o in outs] == expected
    hits = plugin(engine, "prefix_cache").hit_tokens
    assert hits == ((len(second) - 1) // 8) * 8
    assert_all_blocks_back(engine)


def test_prefix_hit_after_preemption_is_counted_apart(tiny_llama):
    prompts = random_prompts([30, 28, 26], seed=14)
    expected = [hf_greedy(tiny_llama, p, 20) for p in prompts]
    engine = cache_engine(tiny_llama, 30, block_size=4)
    outs = run(engine, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert engine.stats.preemptions > 0
    cache = plugin(engine, "prefix_cache")
    assert cache.recompute_hit_tokens > 0 and cache.hit_tokens == 0
    assert_all_blocks_back(engine)


def test_cache_salt_keeps_tenants_apart(tiny_llama):
    prompt = random_prompts([20], seed=15)[0]
    engine = cache_engine(tiny_llama, 32, block_size=4)
    cache = plugin(engine, "prefix_cache")
    for salt in ("a", "b"):
        engine.add_request(prompt, GREEDY, cache_salt=salt)
        run(engine, [], GREEDY)
    assert cache.hit_tokens == 0  # the same prompt under another salt finds nothing
    engine.add_request(prompt, GREEDY, cache_salt="a")
    run(engine, [], GREEDY)
    assert cache.hit_tokens == 16  # tenant "a" again: its own 4 full blocks (the last token is always computed)
    assert_all_blocks_back(engine)


def test_cached_blocks_are_evicted_only_when_no_plain_free_block_is_left(tiny_llama):
    engine = cache_engine(tiny_llama, 12, block_size=4)
    a, b = random_prompts([16, 16], seed=16)
    run(engine, [a], SamplingParams(max_tokens=1))
    cache = plugin(engine, "prefix_cache")
    assert cache.evictions == 0 and engine.pool.num_cached == 4
    assert engine.pool.num_free == 8
    run(engine, [b], SamplingParams(max_tokens=20, ignore_eos=True))  # needs 9 of the 8 plain free blocks
    assert cache.evictions == 1 and engine.pool.num_cached == 3 + 8  # a kept 3; b (35 computed tokens) 8
    assert_all_blocks_back(engine)


def test_eviction_takes_the_least_recently_released_block_and_the_cache_forgets_it(tiny_llama):
    engine = cache_engine(tiny_llama, 10, block_size=4)
    a, b = random_prompts([9, 9], seed=23)
    run(engine, [a], SamplingParams(max_tokens=1))  # 2 full blocks cached
    run(engine, [b], SamplingParams(max_tokens=1))  # 2 more, released after a's
    cache = plugin(engine, "prefix_cache")
    first_cached = engine.pool.cached_blocks()
    assert len(first_cached) == 4 and set(first_cached) == set(cache.block_info)
    pool = engine.pool
    taken = [pool.allocate("x") for _ in range(pool.num_free + 1)]  # every plain block, then one eviction
    evicted = taken[-1]
    assert evicted == first_cached[0] and cache.evictions == 1
    assert evicted not in cache.block_info and pool.cached_blocks() == first_cached[1:]
    pool.decref_many(taken, "x")
    assert_all_blocks_back(engine)


def test_a_hit_revives_cached_blocks_out_of_the_free_queue(tiny_llama):
    engine = cache_engine(tiny_llama, 16, block_size=4)
    prompt = random_prompts([13], seed=24)[0]
    run(engine, [prompt], SamplingParams(max_tokens=1))
    cached = engine.pool.cached_blocks()
    assert len(cached) == 3
    engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    held = engine.scheduler.running[0].block_table.blocks
    assert held[:3] == sorted(cached, key=held.index) and engine.pool.num_cached == 0
    assert all(engine.pool.ref_counts[b] == 1 for b in held)
    run(engine, [], GREEDY)
    assert_all_blocks_back(engine)


def test_admission_bookkeeping_is_bounded_by_live_sequences(tiny_llama):
    """Issue 42 row 13: one entry per sequence ever admitted was kept forever (+8 MB per 100k requests)."""
    engine = cache_engine(tiny_llama, 32, block_size=4)
    cache = plugin(engine, "prefix_cache")
    prompts = random_prompts([9] * 40, seed=25)
    for start in range(0, len(prompts), 8):  # 40 requests, 8 at a time, all finished
        run(engine, prompts[start:start + 8], SamplingParams(max_tokens=2))
    assert cache.query_tokens == 40 * 9  # each admission still counted exactly once
    assert len(cache._counted) == 0  # nothing is left of finished sequences
    assert_all_blocks_back(engine)
