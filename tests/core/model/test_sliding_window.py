"""Sliding-window attention and attention-logit softcapping: token-identical to transformers (greedy, fp32).

Tiny random Mistral (one window for every layer), Gemma 2 (softcapping, sliding
and full layers alternating), Gemma 3 (alternating, its own local RoPE) and Qwen2
with ``use_sliding_window`` (full layers below ``max_window_layers``), each with a window shorter than prompt + output.
A control run without the window (same weights) proves each case depends on it.
"""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, random_prompts
from pagedkv import LLM, SamplingParams

WINDOW = 6
LENGTHS = [3, 9, 21, 14]
MAX_NEW = 12
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
    pad_token_id=0,
)


def tiny_mistral(window: int | None = WINDOW):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(sliding_window=window, **COMMON)).eval()


def tiny_gemma2(window: int | None = WINDOW, softcap: float | None = 0.5):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(sliding_window=window or 10_000, attn_logit_softcapping=softcap, **COMMON)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():  # Gemma's small init gives scores far below any cap: make them large enough to be capped
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def tiny_qwen2(window: int | None = WINDOW):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        sliding_window=window or 10_000, use_sliding_window=True, max_window_layers=1, **COMMON
    )
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    return Qwen2ForCausalLM(cfg).eval()


def tiny_gemma3(window: int | None = WINDOW):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(sliding_window=window or 10_000, sliding_window_pattern=2, **COMMON)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # as for Gemma 2: large enough scores that the window matters within a few tokens
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


BUILDERS = {"mistral": tiny_mistral, "gemma2": tiny_gemma2, "qwen2": tiny_qwen2, "gemma3": tiny_gemma3}


def hf_tokens(model, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time, with its eager attention (the only one Gemma 2 has)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        outs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                     do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
        return outs
    finally:
        model.set_attn_implementation(previous)


def engine_tokens(model, prompts: list[list[int]], backend: str = "torch", max_new: int = MAX_NEW, **config):
    llm = LLM(hf_model=model, device="cpu", backend=backend, **config)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, ignore_eos=True))
    assert llm.engine.pool.num_free == llm.engine.num_blocks, "blocks leaked"
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def cases():
    prompts = random_prompts(LENGTHS, seed=5)
    built = {}
    for name, build in BUILDERS.items():
        model = build()
        built[name] = (model, hf_tokens(model, prompts))
        control = hf_tokens(build(window=None), prompts)
        assert control != built[name][1], f"{name}: the window does not change the tokens; the test would prove nothing"
    return prompts, built


@pytest.mark.parametrize("arch", list(BUILDERS))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_windowed_models_match_transformers_on_the_torch_backend(cases, arch, block_size):
    prompts, built = cases
    model, expected = built[arch]
    assert engine_tokens(model, prompts, block_size=block_size, num_blocks=512 // block_size) == expected


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_windowed_models_match_with_chunked_prefill(cases, arch):
    prompts, built = cases
    model, expected = built[arch]
    got = engine_tokens(model, prompts, block_size=4, num_blocks=128, max_num_batched_tokens=5)
    assert got == expected


def test_gemma2_softcap_changes_tokens_and_is_applied():
    prompts = random_prompts([11, 17], seed=9)
    capped, uncapped = tiny_gemma2(softcap=0.5), tiny_gemma2(softcap=None)
    expected = hf_tokens(capped, prompts)
    assert hf_tokens(uncapped, prompts) != expected, "softcapping must matter in this case"
    assert engine_tokens(capped, prompts, block_size=4, num_blocks=64) == expected


def test_triton_backend_matches_transformers_with_window_and_softcap(cases):
    pytest.importorskip("triton")
    prompts, built = cases
    for arch in ("mistral", "gemma2"):
        model, expected = built[arch]
        got = engine_tokens(model, prompts[:2], backend="triton", max_new=6, block_size=4, num_blocks=32,
                            max_num_batched_tokens=8)
        assert got == [tokens[:6] for tokens in expected[:2]], arch
