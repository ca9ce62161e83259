"""The CPU swap plugin: a SwapSpace the scheduler parks preempted sequences' blocks in."""

from __future__ import annotations

import torch
from plugin_helpers import assert_all_blocks_back, plugin, run

from conftest import hf_greedy, random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core.kv.swap_space import SwapSpace


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


def test_the_plugin_is_the_engines_swap_space_and_the_runner_copies_into_its_host_caches(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=30, swap_space="1MiB"), model=tiny_llama)
    swap = plugin(engine, "cpu_swap")
    assert isinstance(swap, SwapSpace) and engine.swap_space is swap and engine.scheduler.swap_space is swap
    runner = engine.runner
    assert len(runner.cpu_kv_caches) == len(runner.kv_caches)
    assert runner.cpu_kv_caches[0][0].shape[0] == swap.num_blocks == engine.kv_view().num_cpu_blocks
    for k, v in runner.kv_caches:  # the cache starts unzeroed: garbage may hold NaN, which equals nothing
        k[3].normal_()
        v[7].normal_()
    before = [(k[3].clone(), v[7].clone()) for k, v in runner.kv_caches]
    engine.backend.swap_blocks(runner.kv_caches, runner.cpu_kv_caches, torch.tensor([[3, 0], [7, 1]]))
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    engine.backend.swap_blocks(runner.cpu_kv_caches, runner.kv_caches, torch.tensor([[0, 3], [1, 7]]))
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert k[3].equal(k0) and v[7].equal(v0)


def test_too_little_swap_space_for_one_block_means_no_swap_space():
    from types import SimpleNamespace

    shape = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            hidden_size=64, max_position_embeddings=4096, vocab_size=1000)
    from pagedkv.sim.simulated_runner import SimulatedRunner

    config = EngineConfig(device="cpu", block_size=4, num_blocks=8, swap_space=16)
    engine = Engine(config, runner=SimulatedRunner(shape))
    assert engine.swap_space is None and engine.scheduler.swap_space is None
    assert plugin(engine, "cpu_swap").pagedkv_report_stats()["cpu_swap_blocks"] == 0


def test_swapped_request_can_be_aborted(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=20, swap_space="4MiB"), model=tiny_llama)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts([20, 20, 20], seed=20)]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    swap = plugin(engine, "cpu_swap")
    held = swap.blocks_of(victim)
    assert held and swap.cpu_pool.num_free == swap.cpu_pool.num_blocks - len(held)
    assert victim not in engine.scheduler.running
    assert engine.abort(victim.request_id)
    assert swap.blocks_of(victim) == [] and swap.cpu_pool.num_free == swap.cpu_pool.num_blocks
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        engine.check_invariants()
    assert set(finished) == set(ids) - {victim.request_id}
    assert all(len(out.token_ids) == 30 for out in finished.values())
    assert_all_blocks_back(engine)
