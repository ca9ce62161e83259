"""``dtype=bfloat16`` on the cpu backend: pagedkv's Llama runs its layers on the fused kernel and its LM head on the
linear kernel, both on bf16 panels (not torch's matmuls); logits (a forward, and the engine's teacher-forced prompt
logprobs) stay as close to an fp32 run of the same bf16 weights as torch's own bf16 arithmetic is."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_checkpoint import BLOCK, VOCAB, save_tiny

from conftest import drain, random_prompts
from pagedkv.backends.cpu import build
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.model.cpu_linear import PackedLinear, packed_linears
from pagedkv.core.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler: no cpu kernel")


def bf16_engine(path, backend: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Engine:
    return Engine(EngineConfig(model=str(path), backend=backend, device="cpu", dtype=dtype, num_blocks=96,
                               block_size=BLOCK))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_llama_bf16"), dtype=torch.bfloat16, seed=5)


def test_bf16_layers_and_lm_head_run_on_the_kernels(tiny_dir):
    eng = bf16_engine(tiny_dir)
    kernel, fused = eng.runner.linear_kernel, eng.runner.layer_kernel
    assert kernel is not None and torch.bfloat16 in kernel.dtypes and fused is not None
    calls = []
    real = kernel.linear

    def counted(x, packed, bias, out_features):
        calls.append((x.dtype, packed.dtype, packed.dim()))
        return real(x, packed, bias, out_features)

    kernel.linear = counted
    layer_calls = [0]
    real_mlp = fused.mlp

    def counted_mlp(*args):
        layer_calls[0] += 1
        return real_mlp(*args)

    fused.mlp = counted_mlp
    prompts = [[t % VOCAB or 1 for t in p] for p in random_prompts([3, 17, 70], seed=2)]
    ids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) for p in prompts]
    results, steps = drain(eng)
    assert layer_calls[0] == steps * len(eng.model.model.layers), "every layer of every step fused"
    assert len(calls) == steps, "the LM head of every step on the linear kernel"
    assert set(calls) == {(torch.bfloat16, torch.bfloat16, 4)}, "bf16 inputs on the bf16 panels"
    assert all(len(results[i].outputs[0].token_ids) == 6 for i in ids)
    assert eng.pool.num_used == 0


def prompt_logprobs(eng: Engine, prompt: list[int]) -> torch.Tensor:
    """The engine's teacher-forced log-probabilities of the prompt's tokens 1.. (its prefill's logits)."""
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    results, _ = drain(eng)
    entries = results[rid].prompt_logprobs[1:]
    assert eng.pool.num_used == 0
    return torch.tensor([entry[token] for entry, token in zip(entries, prompt[1:])], dtype=torch.float64)


def test_bf16_engine_logprobs_as_close_to_fp32_as_torch_bf16(tiny_dir):
    prompt = [t % VOCAB or 1 for t in random_prompts([50], seed=11)[0]]
    exact = prompt_logprobs(bf16_engine(tiny_dir, "torch", torch.float32), prompt)  # the bf16 weights in fp32
    by_torch = prompt_logprobs(bf16_engine(tiny_dir, "torch"), prompt)
    ours = bf16_engine(tiny_dir)
    assert ours.runner.layer_kernel is not None
    by_kernels = prompt_logprobs(ours, prompt)
    kernel_err, torch_err = (by_kernels - exact).abs().max(), (by_torch - exact).abs().max()
    assert kernel_err <= 2 * torch_err + 1e-3, (kernel_err, torch_err)


def test_bf16_logits_as_close_to_fp32_as_torch_bf16(tiny_dir):
    eng = bf16_engine(tiny_dir)
    model = eng.model
    fp32 = copy.deepcopy(model).float()  # the same (bf16-valued) weights, fp32 arithmetic
    ids = torch.tensor(random_prompts([40], seed=9))
    with torch.inference_mode():
        exact = fp32(input_ids=ids).logits.double()
        by_torch = model(input_ids=ids).logits.double()  # plain nn.Linear outside packed_linears
        with packed_linears(True, eng.runner.linear_kernel):
            by_kernel = model(input_ids=ids).logits.double()
    assert all(m._pack is not None and m._pack.dtype == torch.bfloat16 for m in model.modules()
               if isinstance(m, PackedLinear)), "the forward must have run the kernel's packs"
    kernel_err, torch_err = (by_kernel - exact).abs().max(), (by_torch - exact).abs().max()
    assert kernel_err <= 2 * torch_err + 1e-3, (kernel_err, torch_err)
    assert kernel_err <= 0.05 * exact.abs().max()
    agree = (by_kernel.argmax(-1) == exact.argmax(-1)).double().mean()
    assert agree >= (by_torch.argmax(-1) == exact.argmax(-1)).double().mean() - 0.1
