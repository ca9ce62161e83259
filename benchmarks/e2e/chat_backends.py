"""The 32-request chat workload (benchmarks/workload.py) through pagedkv with each CPU attention backend.

Run: ``.venv/bin/python benchmarks/e2e/chat_backends.py [--threads N] [--backends torch,cpu]``. Both backends run
in one process, alternating, twice each; the report gives output tokens/s per run and checks that every
backend produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backends", default="torch,cpu")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from bench_common import model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from workload import build_workload

    from pagedkv import LLM, SamplingParams

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    work = build_workload(tokenizer, num_requests=32)
    llms = {}
    for name in args.backends.split(","):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        llms[name] = LLM(hf_model=model, tokenizer=tokenizer, device="cpu", backend=name, block_size=16,
                         kv_cache_memory="1GiB")
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    tokens: dict[str, list[list[int]]] = {}
    for round_ in range(args.rounds):
        for name, llm in llms.items():
            started, cpu = time.perf_counter(), time.process_time()
            outs = llm.generate(work.prompt_ids, params)
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
            tokens[name] = [o.token_ids for o in outs]
            produced = sum(len(t) for t in tokens[name])
            print(f"round {round_ + 1} {name:>6}: {produced} tokens in {wall:6.2f} s = {produced / wall:7.1f} tok/s "
                  f"(process CPU {cpu:6.2f} s = {produced / cpu:7.1f} tok/CPU-s), load {os.getloadavg()[0]:.1f}",
                  flush=True)
    same = len({str(t) for t in tokens.values()}) == 1
    print(f"greedy tokens identical across backends: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
