"""Greedy output is token-identical to transformers' own generate (fp32, tiny random models)."""

from __future__ import annotations

import pytest

from conftest import GREEDY_MAX_NEW as MAX_NEW
from pagedkv import LLM, SamplingParams


def run_engine(model, prompts, **config):
    llm = LLM(hf_model=model, device="cpu", **config)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    engine = llm.engine
    assert engine.pool.num_free == engine.num_blocks, "blocks leaked after the run"
    engine.check_invariants()
    return [o.token_ids for o in outs], engine


@pytest.mark.parametrize("backend", ["torch", "cpu"])  # the readable reference and the compiled CPU kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_greedy_tokens_match_transformers_generate(tiny_models, references, arch, block_size, backend):
    prompts, refs = references
    got, engine = run_engine(tiny_models[arch], prompts, block_size=block_size, num_blocks=2048 // block_size,
                             backend=backend)
    assert engine.config.backend == backend
    assert got == refs[arch]
    assert engine.stats.preemptions == 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_tokens_match_under_preemption(tiny_models, references, arch):
    prompts, refs = references
    # 12 blocks of 8 = 96 tokens: the longest request needs 88, so they cannot all run at once
    got, engine = run_engine(tiny_models[arch], prompts, block_size=8, num_blocks=12)
    assert engine.stats.preemptions > 0, "the budget was meant to force preemption"
    assert engine.stats.tokens_recomputed > 0
    assert got == refs[arch]


def test_greedy_tokens_match_with_chunked_prefill(tiny_models, references):
    prompts, refs = references
    got, engine = run_engine(tiny_models["qwen2"], prompts, block_size=4, num_blocks=256, max_num_batched_tokens=7)
    assert got == refs["qwen2"]
    assert engine.stats.steps > MAX_NEW + 64 // 7, "prompts were meant to be split into chunks"


def test_static_allocator_gives_the_same_tokens_with_more_waste(tiny_models, references):
    prompts, refs = references
    got, static = run_engine(
        tiny_models["llama"], prompts, block_size=16, num_blocks=32, allocator="static", max_model_len=128
    )
    assert got == refs["llama"]
    _, paged = run_engine(tiny_models["llama"], prompts, block_size=16, num_blocks=32, max_model_len=128)
    assert static.stats.waste_at_peak > paged.stats.waste_at_peak
    assert static.stats.peak_running < paged.stats.peak_running
