"""Helpers shared by the per-plugin tests (prefix cache, copy-on-write, CPU swap)."""

from __future__ import annotations

from conftest import drain
from pagedkv import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def run(engine, prompts, params):
    """Add every prompt, drain the engine, return the outputs in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results, _ = drain(engine, limit=2000)
    return [results[i] for i in ids]


def plugin(engine, name):
    """The per-engine instance a built-in plugin registered in ``pagedkv_configure``."""
    return engine.pm.get_plugin(f"{name}.instance")


def assert_all_blocks_back(engine):
    """Every device block is free or cached (and the cache agrees), no swap block is held, invariants hold."""
    cache = plugin(engine, "prefix_cache")
    if cache is not None:
        cache.check(engine.pool)
    else:
        assert engine.pool.num_cached == 0
    assert engine.pool.num_available == engine.num_blocks
    swap = plugin(engine, "cpu_swap")
    if swap is not None and swap.cpu_pool is not None:
        assert swap.cpu_pool.num_free == swap.cpu_pool.num_blocks and not swap.tables
    engine.check_invariants()
