"""End to end on the Triton backend (CPU: through the interpreter): same tokens as torch and transformers."""

from __future__ import annotations

import pytest

from conftest import hf_greedy, random_prompts
from pagedkv import LLM, SamplingParams

pytest.importorskip("triton")


def test_triton_engine_matches_torch_backend_and_transformers(tiny_models):
    model = tiny_models["qwen2"]  # GQA 4:1
    prompts = random_prompts([5, 19], seed=31)
    expected = [hf_greedy(model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(hf_model=model, device="cpu", backend=backend, block_size=16, num_blocks=8,
                  max_num_batched_tokens=12)  # chunked prefill: a chunk after cached context
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.pool.num_free == llm.engine.num_blocks
    model.set_attn_implementation("sdpa")
    assert outs["triton"] == outs["torch"] == expected
