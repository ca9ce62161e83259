"""How much running the default model in bf16 (``--dtype bfloat16``, or ``auto`` on a CPU with a fast bf16 path)
changes its output against fp32: the same checkpoint, weights and KV cache rounded to bf16, ``cpu`` backend (the
bf16 weights through the packed kernels: ``vdpbf16ps`` on AVX-512-BF16, widened in registers elsewhere).

On prompts cut from a fixed local text (``data/kv_quant_text.txt``):

- teacher-forced greedy agreement: the fp32 engine's greedy continuation of each prompt is fed to both models in
  packed forwards, and the share of positions where bf16's argmax equals fp32's;
- free-running agreement: the bf16 engine's own greedy output against fp32's, position by position, and the mean
  length of the identical prefix;
- mean and max absolute logit error over the teacher-forced positions;
- perplexity of the whole text (windows of ``--window`` tokens) under both, and its change.

Usage (small enough for a shared 2-core machine):

    .venv/bin/python benchmarks/e2e/bf16_accuracy.py --prompts 16 --tokens 64 --threads 1 [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

from bench_common import (  # noqa: E402
    DATA,
    accuracy_args,
    facts,
    greedy_outputs,
    packed_logits,
    perplexity,
    span_logits,
    text_prompts,
)

from pagedkv import Engine, EngineConfig  # noqa: E402
from pagedkv.backends.cpu.backend import CpuBackend  # noqa: E402
from pagedkv.core.model.model_loader import load_model  # noqa: E402

TEXT = DATA / "kv_quant_text.txt"
BLOCK = 16


def logits_fn(model: Any) -> Any:
    """Packed-prefill logits through the cpu backend on a cache of the model's own dtype."""
    return lambda sequences: packed_logits(model, CpuBackend(), model.dtype, sequences, BLOCK)


def generate(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    engine = Engine(EngineConfig(device="cpu", backend="cpu", block_size=BLOCK, kv_cache_memory="128MiB",
                                 dtype=model.dtype), model=model, tokenizer=tokenizer)
    return greedy_outputs(engine, prompts, tokens)


def compare(models: dict[str, Any], prompts: list[list[int]], forced: list[list[int]], tokens: int) -> dict:
    """Teacher-forced argmax agreement and logit error of bf16 against fp32 on fp32's continuations."""
    spans = (span_logits(logits_fn(models[name]), prompts, forced, tokens) for name in ("fp32", "bf16"))
    agree = count = 0
    err_sum, err_max = 0.0, 0.0
    for base, got in zip(*spans):
        err = (got - base).abs()
        agree += (got.argmax(-1) == base.argmax(-1)).sum().item()
        err_sum += err.double().sum().item()
        err_max = max(err_max, err.max().item())
        count += err.numel()
    return {"teacher_forced_agreement": agree / (tokens * len(prompts)), "mean_abs_logit_error": err_sum / count,
            "max_abs_logit_error": err_max}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    fp32, tokenizer, _ = load_model(None, torch.float32, "cpu")
    bf16, _, _ = load_model(None, torch.bfloat16, "cpu")
    models = {"fp32": fp32, "bf16": bf16}
    text_ids = tokenizer.encode(TEXT.read_text())
    prompts = text_prompts(text_ids, args.prompts, args.prompt_len)
    base = generate(fp32, tokenizer, prompts, args.tokens)
    free = generate(bf16, tokenizer, prompts, args.tokens)
    same = sum(a == b for o, r in zip(free, base) for a, b in zip(o, r))
    prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(free, base)]
    ppl = {name: perplexity(logits_fn(m), text_ids, args.window) for name, m in models.items()}
    return {
        "prompts": args.prompts, "prompt_tokens": args.prompt_len, "tokens": args.tokens,
        "text_tokens": len(text_ids), "window": args.window, "threads": torch.get_num_threads(),
        "bf16_path": getattr(CpuBackend().linear_kernel, "bf16_path", None) or "torch's matmuls",
        **compare(models, prompts, base, args.tokens),
        "free_running_agreement": same / (args.tokens * len(prompts)),
        "mean_identical_prefix": sum(prefix) / len(prefix),
        "perplexity_fp32": ppl["fp32"], "perplexity_bf16": ppl["bf16"],
        "perplexity_change": ppl["bf16"] / ppl["fp32"] - 1,
        "facts": facts(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = accuracy_args(parser)
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
