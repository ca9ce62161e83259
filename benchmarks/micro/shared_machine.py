"""Throughput with a neighbour burning one core vs quiet (issue 43 item 5): batch-1 decode tok/s and 32 chats at
once, SmolLM2 on the cpu backend, each measurement in a fresh process (OpenMP reads its wait policy when it loads).

Run: ``.venv/bin/python benchmarks/micro/shared_machine.py [--rounds 3] [--env NAME=VALUE ...] [--threads N]``.
Rounds alternate quiet / neighbour so the other load on a shared machine hits both alike; prints medians and
the neighbour/quiet ratio. ``--one`` is the child: one measurement, printed as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common

PROMPT = "Write a short story about a lighthouse keeper and a storm."


def measure(threads: int | None, chats: int, tokens: int) -> dict:
    """Decode tok/s of one greedy request, and of ``chats`` requests at once (prefill included), warm."""
    import pagedkv  # noqa: I001 (first: its OpenMP wait policy must be in the environment before torch loads)
    import torch
    from bench_common import model_dir

    LLM, SamplingParams = pagedkv.LLM, pagedkv.SamplingParams

    if threads:
        torch.set_num_threads(threads)
    llm = LLM(model=model_dir(), device="cpu", dtype="float32", block_size=16, kv_cache_memory="256MiB")
    engine = llm.engine
    prompt = engine.encode_prompt(PROMPT)[1]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)

    def run(n: int, skip_prefill: bool) -> float:
        for _ in range(n):
            engine.add_request(prompt, params)
        if skip_prefill:
            engine.step()
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    run(1, True)  # warm-up: packs the weights
    batch1 = (tokens - 1) / run(1, True)
    many = chats * tokens / run(chats, False)
    return {"batch1": batch1, "chats": many, "threads": torch.get_num_threads(),
            "wait": {k: os.environ.get(k, "unset") for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}


def child(args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--one", "--chats", str(args.chats), "--tokens", str(args.tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the measured process")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.threads, args.chats, args.tokens)))
        return 0
    env = dict(item.split("=", 1) for item in args.env)
    results: dict[str, list[dict]] = {"quiet": [], "neighbour": []}
    for _ in range(args.rounds):
        results["quiet"].append(child(args, env))
        burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            results["neighbour"].append(child(args, env))
        finally:
            burner.kill()
            burner.wait()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("batch1", "chats")} for k, v in results.items()}
    print(json.dumps({"env": env, "threads": results["quiet"][0]["threads"], "median": med, "raw": results}))
    for m in ("batch1", "chats"):
        print(f"{m}: quiet {med['quiet'][m]:.1f} tok/s, neighbour {med['neighbour'][m]:.1f} tok/s, "
              f"ratio {med['neighbour'][m] / med['quiet'][m]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
