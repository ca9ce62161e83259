"""The cpu backend's fused Llama layer and packed linear inside the engine: offered to pagedkv's own Llama on
fp32 and bf16, actually taken, and greedy tokens equal to transformers' ``generate`` with every block
back."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoint import BLOCK, VOCAB, save_tiny

from conftest import drain, hf_greedy, random_prompts
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.linear import CpuLinearKernel
from pagedkv.backends.cpu.llama_layers import CpuLlamaLayers
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: no cpu kernel")


def engine(path, impl="pagedkv", backend="cpu", dtype=torch.float32) -> Engine:
    return Engine(EngineConfig(model=str(path), model_impl=impl, backend=backend, device="cpu", dtype=dtype,
                               num_blocks=96, block_size=BLOCK))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_llama"))


def test_kernels_are_offered_to_pagedkv_llama_on_fp32_and_bf16(tiny_dir):
    ours = engine(tiny_dir)
    assert isinstance(ours.runner.layer_kernel, CpuLlamaLayers)
    assert isinstance(ours.runner.linear_kernel, CpuLinearKernel)
    theirs = engine(tiny_dir, impl="transformers")
    assert theirs.runner.layer_kernel is None, "the fused layer is pagedkv's Llama's only"
    assert isinstance(theirs.runner.linear_kernel, CpuLinearKernel)
    by_torch = engine(tiny_dir, backend="torch")
    assert by_torch.runner.layer_kernel is None and by_torch.runner.linear_kernel is None
    bf16 = engine(tiny_dir, dtype=torch.bfloat16)  # bf16 layers on the bf16 panels (test_cpu_bf16_engine.py)
    layer = bf16.model.model.layers[0]
    assert bf16.runner.layer_kernel.accepts(layer, torch.zeros(1, 1, 64, dtype=torch.bfloat16))
    assert not bf16.runner.layer_kernel.accepts(layer, torch.zeros(1, 1, 64)), "fp32 activations, bf16 weights"


@pytest.mark.parametrize("overrides", [{}, dict(head_dim=24, num_key_value_heads=1, num_attention_heads=3,
                                                hidden_size=72, tie_word_embeddings=False)],
                         ids=["gqa", "mqa_head_dim_24"])
def test_fused_greedy_equals_transformers_generate(tmp_path, overrides):
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path, seed=3, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = engine(path)
    fused = ours.runner.layer_kernel
    calls = {"attention_inputs": 0, "queries_into_cache": 0, "mlp": 0}
    for name in calls:  # count the fused calls: the test must run the fused path, not the op-by-op one
        real = getattr(fused, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        setattr(fused, name, counted)
    # a prefill past the parallel threshold (16 rows) and the row chunk (60), decodes batched with it
    prompts = [[t % VOCAB or 1 for t in p] for p in random_prompts([3, 17, 1, 70, 30], seed=4)]
    ids = [ours.add_request(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)) for p in prompts]
    outputs, steps = drain(ours)
    layers = len(ours.model.model.layers)
    # (the kernel writes k/v into the paged cache itself: attention_inputs + the backend's write are its fallback)
    assert calls == {"attention_inputs": 0, "queries_into_cache": steps * layers, "mlp": steps * layers}
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid].outputs[0].token_ids == hf_greedy(reference, prompt, 10), f"prompt of {len(prompt)}"
    assert ours.pool.num_used == 0


def test_no_fused_layer_when_the_packed_copies_would_not_fit_in_memory(tiny_dir, monkeypatch):
    from pagedkv.core.model import cpu_linear

    monkeypatch.setattr(cpu_linear, "available_memory", lambda: 1000)  # bytes: far less than 2x the weights
    small = engine(tiny_dir)
    assert small.runner.layer_kernel is None, "the fused layer packs the weights too: refused like the linears"
    assert not small.runner.packed_linears
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    rid = small.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    results, _ = drain(small)
    assert results[rid].outputs[0].token_ids == hf_greedy(reference, [5, 6, 7], 6)
    assert small.pool.num_used == 0
