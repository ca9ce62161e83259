"""The KV cache is allocated without zeroing (start-up), so nothing may read a slot no step has written.

Every engine here starts with every KV slot (device and swap host tensors) reading as NaN, and runs
prefix caching, copy-on-write forks, CPU swap and preemption over each backend and KV dtype: a read of
an unwritten slot as data would turn logits into NaN and change the greedy tokens. The reference is the
same engine on a zeroed cache.
"""

from __future__ import annotations

import pytest
import torch
from plugin_helpers import assert_all_blocks_back, run

from conftest import random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core.kv.kv_dtype import SCALE_NAN, byte_view, is_quantized, split_cache

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
FORKED = SamplingParams(max_tokens=12, ignore_eos=True, n=2)


def _fill(cache: torch.Tensor, head_dim: int, poison: bool) -> None:
    if not poison:
        byte_view(cache).zero_()
    elif is_quantized(cache.dtype):  # junk values under a NaN scale
        byte_view(cache).fill_(77)
        split_cache(cache, head_dim)[1].fill_(SCALE_NAN)
    else:
        cache.fill_(float("nan"))


def _engine(model, backend: str, kv_dtype: str, poison: bool) -> Engine:
    engine = Engine(
        EngineConfig(device="cpu", backend=backend, block_size=4, num_blocks=22, swap_space="256KiB",
                     kv_cache_dtype=kv_dtype, enable_prefix_caching=True, enable_copy_on_write=True),
        model=model,
    )
    head_dim = engine.spec.head_dim
    for pair in [*engine.runner.kv_caches, *(engine.runner.cpu_kv_caches or [])]:
        for cache in pair:
            _fill(cache, head_dim, poison)
    return engine


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_an_engine_on_a_nan_filled_cache_generates_what_it_does_on_a_zeroed_one(tiny_llama, backend, kv_dtype):
    system = random_prompts([13], seed=41)[0]
    prompts = [system + t for t in random_prompts([6, 10, 3, 7, 5], seed=42)]
    params = [GREEDY, FORKED, GREEDY, FORKED, GREEDY]
    results = []
    for poison in (False, True):
        engine = _engine(tiny_llama, backend, kv_dtype, poison)
        first = run(engine, prompts[:1], GREEDY)  # its full blocks stay cached: the later prompts hit them
        outs = run(engine, prompts, params)
        stats = engine.plugin_stats()
        assert stats["prefix_hit_tokens"] > 0 and stats["cow_copies"] > 0 and stats["swap_outs"] > 0
        assert engine.stats.preemptions > 0
        assert_all_blocks_back(engine)
        results.append(_tokens(first) + _tokens(outs))
    zeroed, poisoned = results
    assert poisoned == zeroed
    assert all(t >= 0 for o in poisoned for c in o for t in c)
