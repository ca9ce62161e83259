"""How much a quantized KV cache (``--kv-cache-dtype``) changes a model's output, against the unquantized one.

For each model and KV dtype, on prompts cut from a fixed local text (``data/kv_quant_text.txt``):

- teacher-forced greedy agreement: the unquantized cache's greedy continuation of each prompt is fed back
  in one forward pass, and the share of positions whose argmax is the same token under the quantized cache;
- free-running agreement: the engine generates greedily with the quantized cache, and the share of output
  tokens equal (same position) to the unquantized run's, with the mean length of the identical prefix;
- mean and max absolute logit error over the teacher-forced continuation positions;
- perplexity of the whole text (windows of ``--window`` tokens), and its change from the unquantized cache.

Every forward pass is the engine's own (``ModelRunner`` on a paged cache of that dtype, torch backend), so
keys and values always come from the cache. Usage (small enough for a shared 2-core machine):

    .venv/bin/python benchmarks/e2e/kv_quant_accuracy.py --prompts 16 --tokens 64 [--models smollm2,tiny] [--json]
        [--kv-dtypes auto,int8] [--scale-format bf16]   # the former 2-byte scale, on the same prompts
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case

from bench_common import DATA, accuracy_args, greedy_outputs, model_dir, packed_logits, text_prompts  # noqa: E402
from bench_common import perplexity as text_perplexity  # noqa: E402
from bench_common import span_logits as forced_spans  # noqa: E402

from pagedkv import Engine, EngineConfig  # noqa: E402
from pagedkv.backends.torch_ref import TorchBackend  # noqa: E402
from pagedkv.core.config import parse_kv_cache_dtype  # noqa: E402

TEXT = DATA / "kv_quant_text.txt"
DTYPES = ("auto", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2")
BLOCK = 16


def load(name: str) -> tuple[Any, Any]:
    """(model, tokenizer) in float32: the real SmolLM2-135M-Instruct, or a tiny random Llama (GPT-2 tokenizer-free:
    its prompts are the text's SmolLM2 token ids folded into its vocabulary)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if name == "smollm2":
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), tokenizer
    from pagedkv.testing import tiny_llama

    return tiny_llama(seed=0), tokenizer


def forward_logits(model: Any, kv_dtype: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    """float32 logits at every position of each sequence, one packed prefill through a paged cache of ``kv_dtype``."""
    return packed_logits(model, TorchBackend("cpu"), parse_kv_cache_dtype(kv_dtype, torch.float32), sequences, BLOCK)


def logits_fn(model: Any, kv_dtype: str) -> Callable[[list[list[int]]], list[torch.Tensor]]:
    return lambda sequences: forward_logits(model, kv_dtype, sequences)


def generate(model: Any, kv_dtype: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    engine = Engine(EngineConfig(device="cpu", backend="torch", block_size=BLOCK, kv_cache_memory="256MiB",
                                 kv_cache_dtype=kv_dtype, dtype="float32"), model=model)
    return greedy_outputs(engine, prompts, tokens)


def span_logits(model: Any, kv_dtype: str, prompts: list[list[int]], base_out: list[list[int]], tokens: int,
                chunk: int) -> Iterator[torch.Tensor]:
    """Teacher-forced logits of the rows predicting each continuation ``[tokens, vocab]``, ``chunk`` sequences per
    forward pass: all 64 x 160 positions' full-vocabulary logits at once would be 2 GB."""
    return forced_spans(logits_fn(model, kv_dtype), prompts, base_out, tokens, chunk)


def perplexity(model: Any, kv_dtype: str, text_ids: list[int], window: int) -> float:
    return text_perplexity(logits_fn(model, kv_dtype), text_ids, window, chunk=len(text_ids))


def measure(name: str, num_prompts: int, tokens: int, prompt_len: int, window: int,
            progress: Any = None, kv_dtypes: tuple[str, ...] = DTYPES, chunk: int = 4) -> dict[str, Any]:
    """The figures for one model; ``progress(kv_dtype, row)`` is called as each dtype's row is done."""
    model, tokenizer = load(name)
    vocab = model.config.vocab_size
    text_ids = [t % vocab for t in tokenizer(TEXT.read_text())["input_ids"]]
    prompts = text_prompts(text_ids, num_prompts, prompt_len)
    base_out = generate(model, "auto", prompts, tokens)
    base_logits = list(span_logits(model, "auto", prompts, base_out, tokens, chunk))  # only the span: 25 MB a prompt
    base_ppl = perplexity(model, "auto", text_ids, window)
    rows = {}
    for kv_dtype in kv_dtypes:
        started = time.perf_counter()
        logits = iter(base_logits) if kv_dtype == "auto" else span_logits(model, kv_dtype, prompts, base_out, tokens,
                                                                           chunk)
        agree = count = 0
        err_sum, err_max = 0.0, 0.0
        for base, got in zip(base_logits, logits):
            err = (got - base).abs()
            agree += (got.argmax(-1) == base.argmax(-1)).sum().item()
            err_sum += err.double().sum().item()
            err_max = max(err_max, err.max().item())
            count += err.numel()
        out = base_out if kv_dtype == "auto" else generate(model, kv_dtype, prompts, tokens)
        same = sum(a == b for o, r in zip(out, base_out) for a, b in zip(o, r))
        prefix = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(out, base_out)]
        ppl = base_ppl if kv_dtype == "auto" else perplexity(model, kv_dtype, text_ids, window)
        rows[kv_dtype] = {
            "teacher_forced_agreement": agree / (tokens * len(prompts)),
            "free_running_agreement": same / (tokens * len(prompts)),
            "mean_identical_prefix": sum(prefix) / len(prefix),
            "mean_abs_logit_error": err_sum / count,
            "max_abs_logit_error": err_max,
            "perplexity": ppl,
            "perplexity_change": ppl / base_ppl - 1,
            "seconds": time.perf_counter() - started,
        }
        if progress is not None:
            progress(kv_dtype, rows[kv_dtype])
    return {"model": name, "prompts": num_prompts, "prompt_tokens": prompt_len, "tokens": tokens,
            "text_tokens": len(text_ids), "window": window, "by_kv_dtype": rows}


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} ({result.get('scale_format', 'e5m3')} row scale): {result['prompts']} prompts x "
             f"{result['prompt_tokens']} tokens, "
             f"{result['tokens']} generated; perplexity over {result['text_tokens']} tokens "
             f"(windows of {result['window']})",
             f"{'kv dtype':<10} {'forced agree':>12} {'free agree':>10} {'same prefix':>11} {'mean |dlogit|':>13} "
             f"{'max |dlogit|':>12} {'ppl':>8} {'ppl change':>10}"]
    for dtype, r in result["by_kv_dtype"].items():
        lines.append(f"{dtype:<10} {r['teacher_forced_agreement']:>12.2%} {r['free_running_agreement']:>10.2%} "
                     f"{r['mean_identical_prefix']:>11.1f} {r['mean_abs_logit_error']:>13.4f} "
                     f"{r['max_abs_logit_error']:>12.4f} {r['perplexity']:>8.3f} {r['perplexity_change']:>+10.3%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,tiny")
    parser.add_argument("--kv-dtypes", default=",".join(DTYPES), help="the cache dtypes to measure (auto is the base)")
    parser.add_argument("--chunk", type=int, default=4, help="sequences per teacher-forced forward pass")
    parser.add_argument("--scale-format", choices=("e5m3", "bf16"), default="e5m3",
                        help="the 8-bit rows' scale: the cache's own 1-byte E5M3, or the former 2-byte bfloat16 "
                             "(kv_scale_bf16.py), for a comparison on the same prompts")
    args = accuracy_args(parser)
    if args.scale_format == "bf16":
        import kv_scale_bf16  # next to this script

        kv_scale_bf16.install()
    def progress(kv_dtype: str, row: dict) -> None:  # a long run on a loaded machine keeps what it measured
        print(f"# {kv_dtype}: {json.dumps(row)}", file=sys.stderr, flush=True)

    kv_dtypes = tuple(args.kv_dtypes.split(","))
    unknown = sorted(set(kv_dtypes) - set(DTYPES))
    if unknown:
        parser.error(f"--kv-dtypes: unknown {', '.join(unknown)}; use some of {', '.join(DTYPES)}")
    results = [measure(m, args.prompts, args.tokens, args.prompt_len, args.window, progress, kv_dtypes, args.chunk)
               | {"scale_format": args.scale_format} for m in args.models.split(",")]
    print(json.dumps(results, indent=2) if args.json else "\n\n".join(format_table(r) for r in results))


if __name__ == "__main__":
    main()
