"""Prefix caching, copy-on-write and CPU swap switched on at once."""

from __future__ import annotations

from plugin_helpers import assert_all_blocks_back, run

from conftest import hf_greedy, random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams


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
    assert all(len(c.token_ids) == 16 for o in outs for c in o.outputs)
    assert engine.stats.preemptions > 0
    assert_all_blocks_back(engine)
