"""End to end on the Triton backend: same tokens as torch and transformers.

On a machine with CUDA this runs the compiled kernels on the GPU (a real
end-to-end GPU check); without it, through Triton's interpreter on the CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import random_prompts
from pagedkv import LLM, SamplingParams

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def hf_greedy_on(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate (sdpa, fp32) on the model's own device."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt], device=model.device)
    try:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt):].tolist()


def test_triton_engine_matches_torch_backend_and_transformers(tiny_models):
    model = copy.deepcopy(tiny_models["qwen2"]).to(DEVICE)  # GQA 4:1; a copy, so the shared fixture stays on CPU
    prompts = random_prompts([5, 19], seed=31)
    expected = [hf_greedy_on(model, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(hf_model=model, device=DEVICE, backend=backend, block_size=16, num_blocks=8,
                  max_num_batched_tokens=12)  # chunked prefill: a chunk after cached context
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.pool.num_free == llm.engine.num_blocks
        if DEVICE == "cuda" and backend == "triton":
            assert not llm.engine.backend.interpreted, "on a GPU the kernels must be compiled, not interpreted"
    assert outs["triton"] == outs["torch"] == expected
