"""Prefix caching, copy-on-write and CPU swap: each a pluggy plugin switched on by config."""

from __future__ import annotations

import pytest

from conftest import drain, hf_greedy, random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams


def run(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results, _ = drain(engine, limit=2000)
    return [results[i] for i in ids]


def plugin(engine, name):
    return engine.pm.get_plugin(f"{name}.instance")


def assert_all_blocks_back(engine):
    cache = plugin(engine, "prefix_cache")
    if cache is not None:
        cache.check(engine.pool)
        assert engine.pool.num_free + len(engine.pool.kept) == engine.num_blocks
    else:
        assert engine.pool.num_free == engine.num_blocks
    swap = plugin(engine, "cpu_swap")
    if swap is not None and swap.cpu_pool is not None:
        assert swap.cpu_pool.num_free == swap.cpu_pool.num_blocks and not swap.cpu_blocks
    engine.check_invariants()


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


# --- prefix caching ------------------------------------------------------------------------------


def test_shared_prefix_is_computed_once_and_outputs_match_transformers(tiny_llama):
    system = random_prompts([40], seed=11)[0]
    prompts = [system + tail for tail in random_prompts([5, 9, 3], seed=12)]
    expected = [hf_greedy(tiny_llama, p, 12) for p in prompts]
    engine = Engine(EngineConfig(device="cpu", block_size=8, num_blocks=64, enable_prefix_caching=True),
                    model=tiny_llama)
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
    engine = Engine(EngineConfig(device="cpu", block_size=8, num_blocks=32, enable_prefix_caching=True),
                    model=tiny_llama)
    outs = run(engine, [base], GREEDY) + run(engine, [second], GREEDY)
    assert [o.token_ids for o in outs] == expected
    hits = plugin(engine, "prefix_cache").hit_tokens
    assert hits == ((len(second) - 1) // 8) * 8
    assert_all_blocks_back(engine)


def test_prefix_hit_after_preemption_is_counted_apart(tiny_llama):
    prompts = random_prompts([30, 28, 26], seed=14)
    expected = [hf_greedy(tiny_llama, p, 20) for p in prompts]
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=30, enable_prefix_caching=True),
                    model=tiny_llama)
    outs = run(engine, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert engine.stats.preemptions > 0
    cache = plugin(engine, "prefix_cache")
    assert cache.recompute_hit_tokens > 0 and cache.hit_tokens == 0
    assert_all_blocks_back(engine)


def test_cache_salt_keeps_tenants_apart(tiny_llama):
    prompt = random_prompts([20], seed=15)[0]
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=32, enable_prefix_caching=True),
                    model=tiny_llama)
    engine.add_request(prompt, GREEDY, cache_salt="a")
    while engine.has_unfinished():
        engine.step()
    engine.add_request(prompt, GREEDY, cache_salt="b")
    while engine.has_unfinished():
        engine.step()
    assert plugin(engine, "prefix_cache").hit_tokens == 0


def test_cached_blocks_are_evicted_only_when_the_free_pool_is_empty(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=12, enable_prefix_caching=True),
                    model=tiny_llama)
    a, b = random_prompts([16, 16], seed=16)
    run(engine, [a], SamplingParams(max_tokens=1))
    cache = plugin(engine, "prefix_cache")
    assert cache.evictions == 0 and len(engine.pool.kept) == 4
    run(engine, [b], SamplingParams(max_tokens=20, ignore_eos=True))  # needs 9 of the 8 free blocks: evicts
    assert cache.evictions > 0
    assert_all_blocks_back(engine)


# --- copy-on-write --------------------------------------------------------------------------------


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
    run(cow, [prompt], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1, ignore_eos=True))
    assert plugin(cow, "copy_on_write").copies == 0
    assert_all_blocks_back(cow)


# --- CPU swap ---------------------------------------------------------------------------------------


def test_swap_under_pressure_gives_unconstrained_outputs(tiny_llama):
    prompts = random_prompts([30, 28, 26, 9], seed=19)
    expected = [hf_greedy(tiny_llama, p, 20) for p in prompts]
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=30, swap_space="4MiB"), model=tiny_llama)
    outs = run(engine, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    swap = plugin(engine, "cpu_swap")
    assert swap.swap_outs > 0 and swap.swap_ins == swap.swap_outs
    assert engine.stats.tokens_recomputed == 0
    assert_all_blocks_back(engine)


def test_swap_round_trip_is_bit_exact(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=30, swap_space="1MiB"), model=tiny_llama)
    runner = engine.runner
    before = [(k[3].clone(), v[7].clone()) for k, v in runner.kv_caches]
    engine.backend.swap_blocks(runner.kv_caches, runner.cpu_kv_caches, __import__("torch").tensor([[3, 0], [7, 1]]))
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    engine.backend.swap_blocks(runner.cpu_kv_caches, runner.kv_caches, __import__("torch").tensor([[0, 3], [1, 7]]))
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert k[3].equal(k0) and v[7].equal(v0)


def test_swapped_request_can_be_aborted(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=20, swap_space="4MiB"), model=tiny_llama)
    ids = [engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
           for p in random_prompts([20, 20, 20], seed=20)]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    assert victim not in engine.scheduler.running
    engine.abort(victim.request_id)
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert victim.request_id in ids
    assert_all_blocks_back(engine)


# --- all three ----------------------------------------------------------------------------------------


def test_prefix_cache_cow_and_swap_together(tiny_llama):
    system = random_prompts([12], seed=21)[0]
    prompts = [system + t for t in random_prompts([6, 10, 3, 7], seed=22)]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(n=2, max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    expected = {i: hf_greedy(tiny_llama, prompts[i], 16) for i in (0, 2)}
    engine = Engine(
        EngineConfig(device="cpu", block_size=4, num_blocks=26, swap_space="2MiB",
                     enable_prefix_caching=True, enable_copy_on_write=True),
        model=tiny_llama,
    )
    outs = run(engine, prompts, [greedy, sampled, greedy, sampled])
    assert outs[0].token_ids == expected[0] and outs[2].token_ids == expected[2]
    assert all(len(o.outputs) == n for o, n in zip(outs, [1, 2, 1, 2]))
    assert engine.stats.preemptions > 0
    assert_all_blocks_back(engine)
