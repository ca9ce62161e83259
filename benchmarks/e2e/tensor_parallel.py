"""Tokens/s at tensor_parallel_size 1 and 2 on this machine (CPU, gloo), and the communication share of a step.

A random Llama (seeded; 8 layers, hidden 512, 8 heads, 4 KV heads, MLP 1536, vocab 8192: SmolLM2's 3 KV heads
do not split over 2 ranks) generates greedily for a batch of prompts. Each configuration runs in a fresh engine;
N = 1 with one thread (the baseline: N = 2 gives each rank one thread of the 2 cores) runs before and after
N = 2 so that drift of a shared machine shows; N = 1 with 2 threads is listed too. ``comm`` is the time rank 0 spends in
collectives (the step's broadcast and the layers' all-reduces, waiting for the slower rank included) over the
generation time. The tokens of N = 2 must equal those of N = 1.

    .venv/bin/python benchmarks/e2e/tensor_parallel.py [--prompts 16] [--prompt-len 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.sampling_params import SamplingParams


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def run(tp: int, threads: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 8192, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    started = time.perf_counter()
    engine = Engine(EngineConfig(device="cpu", num_blocks=1024, tensor_parallel_size=tp), model=build_model())
    startup = time.perf_counter() - started
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    group = getattr(engine.runner, "group", None)
    comm_before = group.comm_seconds if group else 0.0
    started = time.perf_counter()
    results = {}
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            results[out.request_id] = list(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - started
    comm = (group.comm_seconds - comm_before) if group else 0.0
    engine.close()
    tokens = sum(len(t) for t in results.values())
    return {"tp": tp, "threads": threads, "startup_s": startup, "elapsed_s": elapsed, "tok_s": tokens / elapsed,
            "steps": engine.stats.steps, "comm_share": comm / elapsed, "tokens": [results[i] for i in ids]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    rows = [run(1, 1, args), run(2, 1, args), run(1, 1, args), run(1, 2, args)]
    print("| N | threads/rank | start s | generate s | output tok/s | ratio vs N=1 (1 thread, mean) | comm share |")
    print("|---|---|---|---|---|---|---|")
    base = (rows[0]["tok_s"] + rows[2]["tok_s"]) / 2
    for r in rows:
        print(f"| {r['tp']} | {r['threads']} | {r['startup_s']:.1f} | {r['elapsed_s']:.2f} | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / base:.2f} | {r['comm_share'] * 100:.0f}% |")
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"tokens identical across all runs: {same}; steps per run: {rows[0]['steps']}")


if __name__ == "__main__":
    main()
