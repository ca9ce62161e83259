"""pagedkv's own Llama against transformers': bit-identical logits of packed steps, equal greedy tokens,
and the whitelist that sends every other checkpoint to transformers."""

from __future__ import annotations

import json
import logging
import random
import struct
import subprocess
import sys

import pytest
import torch
from tiny_checkpoint import BLOCK, VOCAB, save_tiny

from conftest import drain, hf_greedy, random_prompts
from pagedkv.core.config import EngineConfig, parse_model_impl
from pagedkv.core.engine import Engine
from pagedkv.core.errors import ConfigError
from pagedkv.core.model.llama_model import LlamaForCausalLM as NativeLlama
from pagedkv.core.model.model_runner import StepBatch
from pagedkv.core.model.native_config import native_problem
from pagedkv.core.sample.sampling_params import SamplingParams


def engines(path, dtype):
    """(pagedkv's, transformers') engines on the same checkpoint."""
    def make(impl):
        return Engine(EngineConfig(model=str(path), model_impl=impl, device="cpu", dtype=dtype,
                                   num_blocks=64, block_size=BLOCK))
    return make("pagedkv"), make("transformers")


def packed_steps(vocab, seed=0):
    """A prefill of three sequences of unequal lengths on shuffled blocks, then one decode token each."""
    rng = random.Random(seed)
    blocks = list(range(1, 64))
    rng.shuffle(blocks)
    lens = [7, 1, 13]
    tables, start = [], 0
    for n in lens:
        need = -(-(n + 1) // BLOCK)
        tables.append(blocks[start:start + need])
        start += need
    ids = [rng.randrange(1, vocab) for _ in range(sum(lens) + len(lens))]
    prefill_ids, decode_ids = ids[:sum(lens)], ids[sum(lens):]
    rows, at = [], 0
    for n in lens:
        at += n
        rows.append(at - 1)
    prefill = StepBatch(prefill_ids, [p for n in lens for p in range(n)], rows + [0, 5], tables, [0] * 3, lens,
                        [], [], [])
    decode = StepBatch(decode_ids, list(lens), [0, 1, 2], tables, list(lens), [1, 1, 1], [], [], [])
    return prefill, decode


def assert_same_steps(ours, theirs, vocab):
    """Op by op (the backend's fused layer off), pagedkv's Llama gives transformers' logits bit for bit; with
    the fused layer (the cpu backend's, on fp32 and bf16) they agree up to rounding (bf16: the fused layer sums
    in fp32 and rounds once per call where the op-by-op layer rounds every op, so a few bf16 ulps)."""
    assert isinstance(ours.model, NativeLlama) and not isinstance(theirs.model, NativeLlama)
    fused, ours.runner.layer_kernel = ours.runner.layer_kernel, None
    try:
        steps = [(batch, ours.runner.run(batch), theirs.runner.run(batch)) for batch in packed_steps(vocab)]
    finally:
        ours.runner.layer_kernel = fused
    for batch, a, b in steps:
        assert a.shape == b.shape == (len(batch.sample_rows), vocab)
        assert torch.equal(a, b), f"max difference {(a - b).abs().max().item()}"
    if ours.backend.name == "cpu" and ours.model.dtype == torch.float32:
        assert fused is not None, "the cpu backend offers no fused layer"
    if fused is None:
        return
    tol = 2e-4 if ours.model.dtype == torch.float32 else 2.0**-5
    for batch, _, b in steps:  # the same steps again, fused (they rewrite the same cache slots)
        c = ours.runner.run(batch)
        assert c.shape == b.shape and torch.isfinite(c).all()
        assert (c - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


CONFIGS = {
    "gqa": {},
    "head_dim_24_mha_untied": dict(head_dim=24, num_key_value_heads=4, tie_word_embeddings=False),
    "tied_eps_theta": dict(tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0),
    "mqa_three_layers": dict(num_key_value_heads=1, num_hidden_layers=3, rope_theta=1234.5),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_steps_bit_identical(tmp_path, name, dtype):
    path = save_tiny(tmp_path, dtype, **CONFIGS[name])
    ours, theirs = engines(path, dtype)
    assert_same_steps(ours, theirs, VOCAB)


@pytest.mark.parametrize("name", ["gqa", "head_dim_24_mha_untied", "tied_eps_theta"])
def test_greedy_equals_transformers_generate(tmp_path, name):
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path, **CONFIGS[name])
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = engines(path, torch.float32)
    prompts = random_prompts([3, 17, 1, 30], seed=2)
    prompts = [[t % VOCAB or 1 for t in p] for p in prompts]
    ids = [ours.add_request(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)) for p in prompts]
    outputs, _ = drain(ours)
    for rid, prompt in zip(ids, prompts):
        assert outputs[rid].outputs[0].token_ids == hf_greedy(reference, prompt, 12)
    assert ours.pool.num_used == 0


def test_smollm2_bit_identical_and_greedy(smollm2_dir, smollm2):
    reference, tokenizer = smollm2
    ours, theirs = engines(smollm2_dir, torch.float32)
    assert_same_steps(ours, theirs, reference.config.vocab_size)
    del theirs
    prompt = tokenizer("The capital of France is")["input_ids"]
    rid = ours.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    outputs, _ = drain(ours)
    assert outputs[rid].outputs[0].token_ids == hf_greedy(reference, prompt, 10)
    assert ours.eos_token_ids == frozenset({2})
    assert ours.model.config._name_or_path == reference.config._name_or_path == str(smollm2_dir)


@pytest.mark.parametrize("change, why", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 64}}, "rope"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"some_future_switch": 1}, "some_future_switch"),
    ({"architectures": ["MistralForCausalLM"]}, "architectures"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
])
def test_whitelist_refuses(change, why):
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    assert native_problem(base) is None
    problem = native_problem({**base, **change})
    assert problem is not None and why in problem


def test_outside_whitelist_goes_to_transformers(tmp_path, caplog):
    path = save_tiny(tmp_path, attention_bias=True)
    with caplog.at_level(logging.DEBUG, logger="pagedkv.model"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=16, block_size=BLOCK))
    assert not isinstance(engine.model, NativeLlama)
    assert "attention_bias=True" in caplog.text
    with pytest.raises(ConfigError, match="attention_bias"):
        Engine(EngineConfig(model=str(path), model_impl="pagedkv", device="cpu", num_blocks=16))


def test_default_is_native_and_flag_names(tmp_path):
    path = save_tiny(tmp_path)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=16, block_size=BLOCK))
    assert isinstance(engine.model, NativeLlama)
    assert parse_model_impl("vllm") == "pagedkv" and parse_model_impl(None) == "auto"
    from pagedkv.cli.engine_args import engine_config
    from pagedkv.cli.main import build_parser
    from pagedkv.core.llm import LLM

    for command in ("run", "serve"):
        args = build_parser().parse_args([command, "--model-impl", "vllm", "--device", "cpu"])
        assert engine_config(args).model_impl == "pagedkv"
    llm = LLM(str(path), model_impl="transformers", device="cpu", num_blocks=16, block_size=BLOCK)
    assert not isinstance(llm.engine.model, NativeLlama)
    with pytest.raises(ConfigError, match="model_impl"):
        EngineConfig(model_impl="jax")


def test_missing_tensor_falls_back(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny(tmp_path, tie_word_embeddings=False)
    tensors = load_file(path / "model.safetensors")
    tensors.pop("lm_head.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    from pagedkv.core.model.native_loader import try_native

    assert try_native(path, torch.float32, "cpu") is None
    with pytest.raises(ConfigError, match="cannot read the weights"):
        Engine(EngineConfig(model=str(path), model_impl="pagedkv", device="cpu", num_blocks=16))
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=16))  # auto: transformers loads it
    assert not isinstance(engine.model, NativeLlama)


def test_native_load_imports_no_transformers(tmp_path):
    path = save_tiny(tmp_path)
    code = ("import sys, torch; from pagedkv.core.model.native_loader import load_native_llama; "
            f"m = load_native_llama(__import__('pathlib').Path({str(path)!r}), torch.float32, 'cpu'); "
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]"


def test_generation_config_read_without_transformers(tmp_path):
    path = save_tiny(tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7], "bos_token_id": 1}))
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_blocks=16, block_size=BLOCK))
    assert isinstance(engine.model, NativeLlama)
    assert engine.eos_token_ids == frozenset({5, 7})


def test_mmap_reader_matches_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    from pagedkv.core.model.safetensors_mmap import read_safetensors

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.zeros(0, 4),
               "d": torch.randn(2, 2, 2).to(torch.float16)}
    save_file(tensors, tmp_path / "x.safetensors")
    ours, theirs = read_safetensors(tmp_path / "x.safetensors"), load_file(tmp_path / "x.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name])
    save_file({"ids": torch.arange(4)}, tmp_path / "int.safetensors")
    with pytest.raises(ValueError, match="I64"):
        read_safetensors(tmp_path / "int.safetensors")


@pytest.mark.parametrize("content", [
    b"\x00garbage" * 10,  # a header length of ~7e18: must not be read (MemoryError) or allocated
    struct.pack("<Q", 4) + b"[1,2]",  # a header that is not an object
    struct.pack("<Q", 40) + b'{"w": {"dtype": "F32", "shape": "x"}}   ',  # a malformed entry
    struct.pack("<Q", 64) + b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}'.ljust(64) + b"\0" * 8,
])
def test_mmap_reader_refuses_a_corrupt_file_with_a_value_error(tmp_path, content):
    from pagedkv.core.model.safetensors_mmap import read_safetensors

    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError):
        read_safetensors(path)


@pytest.mark.parametrize("values", [{"eos_token_id": 3}, {"temperature": 0.7, "top_k": 50, "max_new_tokens": 9}])
def test_generation_defaults_as_transformers(tmp_path, values):
    from transformers import AutoModelForCausalLM

    from pagedkv.core.model.native_loader import load_native_llama
    from pagedkv.serve.generation_defaults import sampling_defaults

    path = save_tiny(tmp_path)
    (path / "generation_config.json").write_text(json.dumps(values))
    ours = load_native_llama(path, torch.float32, "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert sampling_defaults("auto", ours) == sampling_defaults("auto", theirs)


def test_plain_forward_without_a_step_matches_transformers(tmp_path):
    """The forward GPU memory profiling runs (no KV cache, causal SDPA) computes transformers' logits."""
    from transformers import AutoModelForCausalLM

    from pagedkv.core.model.native_loader import load_native_llama

    path = save_tiny(tmp_path, **CONFIGS["head_dim_24_mha_untied"])
    ours = load_native_llama(path, torch.float32, "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 3, 99, 250, 1, 42]])
    with torch.inference_mode():
        a = ours(input_ids=ids, use_cache=False).logits
        b = theirs(input_ids=ids, use_cache=False).logits
    assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-5)
