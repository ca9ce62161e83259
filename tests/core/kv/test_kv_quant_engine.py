"""The 8-bit KV cache through the whole engine, with every plugin and tensor parallelism.

The reference for a quantized run is the same quantized engine with no plugins and room for everything: a
block's bytes (values and scales) must survive prefix reuse, copy-on-write copies and CPU swaps unchanged,
so the greedy tokens are identical. Against transformers' unquantized greedy run the tokens may differ
(quantization changes the logits a little); agreement there is bounded, not assumed.
"""

from __future__ import annotations

import pytest
import torch
from plugin_helpers import assert_all_blocks_back, run

from conftest import hf_greedy, random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.plugins import telemetry

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
FORKED = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
EIGHT_BIT = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _prompts() -> list[list[int]]:
    system = random_prompts([13], seed=31)[0]
    return [system + t for t in random_prompts([6, 10, 3, 7, 5], seed=32)]


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _reference(model, kv_dtype, prompts, params):
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=512, kv_cache_dtype=kv_dtype), model=model)
    return _tokens(run(engine, prompts, params))


def test_auto_changes_nothing(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=64, kv_cache_dtype="auto"), model=tiny_llama)
    k_cache, _ = engine.runner.kv_caches[0]
    assert k_cache.dtype == torch.float32 and k_cache.shape[-1] == 16 and "MiB of " not in engine.capacity_line()
    prompts = _prompts()[:2]
    assert _tokens(run(engine, prompts, GREEDY)) == [[hf_greedy(tiny_llama, p, MAX_TOKENS)] for p in prompts]


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_quantized_cache_is_allocated_small_and_stays_close_to_the_float_run(tiny_llama, kv_dtype):
    engine = Engine(EngineConfig(device="cpu", block_size=4, kv_cache_memory="1MiB", kv_cache_dtype=kv_dtype),
                    model=tiny_llama)
    fp32 = Engine(EngineConfig(device="cpu", block_size=4, kv_cache_memory="1MiB"), model=tiny_llama)
    k_cache, _ = engine.runner.kv_caches[0]
    assert k_cache.dtype == engine.spec.dtype and k_cache.shape[-1] == 16 + 1
    assert engine.num_blocks / fp32.num_blocks == pytest.approx(4 * 16 / 17, rel=0.01)  # head_dim 16: 1 of 17 bytes
    assert f"of {kv_dtype}" in engine.capacity_line()
    prompts = _prompts()
    got = [t[0] for t in _tokens(run(engine, prompts, GREEDY))]
    expected = [hf_greedy(tiny_llama, p, MAX_TOKENS) for p in prompts]
    first_diff = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), MAX_TOKENS) for g, e in zip(got, expected)]
    assert sum(first_diff) >= (0.9 if kv_dtype == "int8" else 0.5) * MAX_TOKENS * len(prompts), first_diff
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("kv_dtype", EIGHT_BIT)
def test_prefix_cache_copy_on_write_and_swap_keep_the_quantized_blocks_intact(tiny_llama, kv_dtype):
    prompts = _prompts()
    params = [GREEDY, FORKED, GREEDY, FORKED, GREEDY]
    expected = _reference(tiny_llama, kv_dtype, prompts, params)
    engine = Engine(
        EngineConfig(device="cpu", block_size=4, num_blocks=22, swap_space="256KiB", kv_cache_dtype=kv_dtype,
                     enable_prefix_caching=True, enable_copy_on_write=True),
        model=tiny_llama,
    )
    first = run(engine, prompts[:1], GREEDY)  # its full blocks stay cached for the rest: prefix hits
    outs = run(engine, prompts, params)
    assert _tokens(first) == expected[:1] and _tokens(outs) == expected
    stats = engine.plugin_stats()
    assert stats["prefix_hit_tokens"] > 0 and stats["cow_copies"] > 0 and stats["swap_outs"] > 0
    assert engine.stats.preemptions > 0
    assert_all_blocks_back(engine)


@pytest.mark.parametrize("plugin", ["prefix", "cow", "swap"])
def test_each_plugin_alone_with_int8(tiny_llama, plugin):
    prompts = _prompts()
    params = [FORKED if plugin == "cow" else GREEDY] * len(prompts)
    expected = _reference(tiny_llama, "int8", prompts, params)
    settings = {"prefix": dict(enable_prefix_caching=True), "cow": dict(enable_copy_on_write=True),
                "swap": dict(swap_space="256KiB", num_blocks=14)}[plugin]
    engine = Engine(EngineConfig(**{"device": "cpu", "block_size": 4, "num_blocks": 64, "kv_cache_dtype": "int8",
                                    **settings}), model=tiny_llama)
    if plugin == "prefix":
        run(engine, prompts[:1], GREEDY)
    assert _tokens(run(engine, prompts, params)) == expected
    stat = {"prefix": "prefix_hit_tokens", "cow": "cow_copies", "swap": "swap_outs"}[plugin]
    assert engine.plugin_stats()[stat] > 0
    assert_all_blocks_back(engine)


def test_telemetry_block_map_replays_an_int8_run(tiny_llama, tmp_path):
    from pagedkv.monitor.trace import replay

    engine = Engine(
        EngineConfig(device="cpu", block_size=4, num_blocks=22, swap_space="256KiB", kv_cache_dtype="int8",
                     enable_prefix_caching=True, enable_copy_on_write=True, trace=str(tmp_path / "t.ndjson")),
        model=tiny_llama,
    )
    prompts = _prompts()
    run(engine, prompts, [GREEDY, FORKED, GREEDY, FORKED, GREEDY])
    final = telemetry.engine_block_map(engine)
    telemetry.close(engine)
    state = replay(tmp_path / "t.ndjson")
    assert state.block_map() == final and state.ended and state.gaps == 0
    assert_all_blocks_back(engine)


def test_two_tensor_parallel_ranks_hold_their_heads_scales_and_match_one_process():
    from conftest import _tiny_llama

    settings = dict(device="cpu", block_size=4, num_blocks=16, max_num_seqs=4, enable_prefix_caching=True,
                    enable_copy_on_write=True, swap_space=1 << 18, kv_cache_dtype="int8")
    prompts = _prompts()
    params = [GREEDY, FORKED, GREEDY, GREEDY, GREEDY]
    single = Engine(EngineConfig(**settings), model=_tiny_llama(seed=2))
    expected = _tokens(run(single, prompts[:1], GREEDY) + run(single, prompts, params))
    engine = Engine(EngineConfig(**settings, tensor_parallel_size=2), model=_tiny_llama(seed=2))
    try:
        k_cache, _ = engine.runner.kv_caches[0]
        assert k_cache.shape[2:] == (1, 17) and k_cache.dtype == torch.int8  # 1 of 2 KV heads, each with a scale
        assert _tokens(run(engine, prompts[:1], GREEDY) + run(engine, prompts, params)) == expected
        stats = engine.plugin_stats()
        assert stats["swap_outs"] > 0 and stats["prefix_hit_tokens"] > 0
        assert_all_blocks_back(engine)
    finally:
        engine.close()


def test_llm_takes_the_flag_through_the_one_config(tiny_llama):
    from pagedkv import LLM

    llm = LLM(hf_model=tiny_llama, device="cpu", block_size=4, num_blocks=32, kv_cache_dtype="fp8_e4m3")
    assert llm.engine.config.kv_cache_dtype == "fp8_e4m3"
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    [out] = llm.generate([_prompts()[0]], GREEDY)
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
