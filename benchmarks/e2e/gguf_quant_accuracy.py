"""The default model's Q4_1 GGUF run as Q4_1 blocks (``--quantization gguf``) against its fp32 de-quantization: the
same weights, so the two should agree almost exactly; and what the blocks save in memory and time.

On prompts cut from a fixed local text (``data/kv_quant_text.txt``), ``cpu`` backend (the blocks through
``quant_linear.h``, the fp32 weights through the packed kernels):

- teacher-forced greedy agreement: the fp32 model's greedy continuation of each prompt is fed to both in one
  packed forward, and the share of positions where the blocks' argmax equals the fp32 argmax;
- perplexity of the whole text (windows of ``--window`` tokens) under both, and its change;
- resident weight bytes of the blocks' model (each storage once) against the GGUF file's size;
- batch-1 greedy decode tokens per second, the two engines alternated round by round (median of ``--rounds``).

``--method int8`` / ``int4`` measure ``--quantization int8`` / ``int4`` instead: the fp32 checkpoint (the file's
de-quantization, the only full-precision SmolLM2 on a machine without a hub) quantized at load to Q8_0 / Q4_1,
against that fp32 checkpoint itself.

Usage (small enough for a shared 2-core machine):

    .venv/bin/python benchmarks/e2e/gguf_quant_accuracy.py --prompts 16 --tokens 64 --threads 1 [--method int8] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

from bench_common import DATA, accuracy_args, greedy_outputs, packed_logits, span_logits, text_prompts  # noqa: E402
from bench_common import perplexity as text_perplexity  # noqa: E402

from pagedkv import Engine, EngineConfig  # noqa: E402
from pagedkv.backends.cpu.backend import CpuBackend  # noqa: E402
from pagedkv.core.model.model_loader import default_gguf, load_model, resolve_model_dir  # noqa: E402
from pagedkv.core.model.quant_linear import weight_bytes  # noqa: E402

TEXT = DATA / "kv_quant_text.txt"
BLOCK = 16


def forward_logits(model: Any, sequences: list[list[int]]) -> list[torch.Tensor]:
    """float32 logits at every position of each sequence: one packed prefill, ``cpu`` backend."""
    return packed_logits(model, CpuBackend(), torch.float32, sequences, BLOCK)


def engine_for(model: Any, tokenizer: Any) -> Engine:
    return Engine(EngineConfig(device="cpu", backend="cpu", block_size=BLOCK, kv_cache_memory="128MiB",
                               dtype="float32"), model=model, tokenizer=tokenizer)


def generate(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    return greedy_outputs(engine, prompts, tokens)


def perplexity(model: Any, text_ids: list[int], window: int) -> float:
    return text_perplexity(lambda seqs: forward_logits(model, seqs), text_ids, window)


def agreement(quant: Any, fp32: Any, prompts: list[list[int]], forced: list[list[int]], tokens: int) -> float:
    spans = (span_logits(lambda seqs, m=m: forward_logits(m, seqs), prompts, forced, tokens) for m in (quant, fp32))
    agree = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(*spans))
    return agree / (tokens * len(prompts))


def decode_speed(engines: dict[str, Engine], prompt: list[int], tokens: int, rounds: int) -> dict[str, float]:
    """Batch-1 greedy decode tok/s per engine, alternated round by round; medians."""
    seen: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            generate(engine, [prompt], 4)  # warm: packs, caches
            started = time.perf_counter()
            generate(engine, [prompt], tokens)
            seen[name].append(tokens / (time.perf_counter() - started))
    return {name: statistics.median(v) for name, v in seen.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if args.method == "gguf":
        quant, tokenizer, _ = load_model(None, torch.float32, "cpu", quantization="gguf")
    else:  # the fp32 checkpoint as a directory: --quantization int8/int4 refuses the GGUF default model by name
        quant, tokenizer, _ = load_model(str(resolve_model_dir(None)), torch.float32, "cpu",
                                         quantization=args.method)
    fp32, _, _ = load_model(None, torch.float32, "cpu")
    name = {"gguf": "q4_1"}.get(args.method, args.method)
    text_ids = tokenizer.encode(TEXT.read_text())
    prompts = text_prompts(text_ids, args.prompts, args.prompt_len)
    engines = {name: engine_for(quant, tokenizer), "fp32": engine_for(fp32, tokenizer)}
    forced = generate(engines["fp32"], prompts, args.tokens)
    ppl_q, ppl_f = perplexity(quant, text_ids, args.window), perplexity(fp32, text_ids, args.window)
    speed = decode_speed(engines, prompts[0], args.decode_tokens, args.rounds)
    return {
        "prompts": args.prompts, "tokens": args.tokens, "text_tokens": len(text_ids), "window": args.window,
        "threads": torch.get_num_threads(),
        "teacher_forced_agreement": agreement(quant, fp32, prompts, forced, args.tokens),
        f"perplexity_{name}": ppl_q, "perplexity_fp32": ppl_f, "perplexity_change": ppl_q / ppl_f - 1,
        f"weight_bytes_{name}": weight_bytes(quant), "weight_bytes_fp32": weight_bytes(fp32),
        "gguf_file_bytes": default_gguf().stat().st_size,
        "resident_over_file": weight_bytes(quant) / default_gguf().stat().st_size,
        "decode_tok_s": speed, "decode_speedup": speed[name] / speed["fp32"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--method", choices=["gguf", "int8", "int4"], default="gguf",
                        help="gguf: the file's Q4_1 blocks; int8/int4: the fp32 checkpoint quantized at load")
    args = accuracy_args(parser)
    result = measure(args)
    print(json.dumps(result, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
