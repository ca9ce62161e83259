"""Throughput with a neighbour burning one core vs quiet (issue 43 item 5): batch-1 decode tok/s and 32 chats at
once, SmolLM2 on the cpu backend, each measurement in a fresh process (OpenMP reads its wait policy when it loads).

Run: ``.venv/bin/python benchmarks/micro/shared_machine.py [--rounds 3] [--env NAME=VALUE ...] [--threads N]
[--adapt | --compare-adapt]``. Rounds alternate quiet / neighbour so the other load on a shared machine hits both
alike; prints medians and the neighbour/quiet ratio. ``--adapt`` sizes the step's threads between steps as
``engine serve --adapt-threads`` does (core/thread_share.py: it first watches the machine for 2.5 s, as an idle
server would); ``--compare-adapt`` measures without and with it in each round. ``--one`` is the child: one
measurement, printed as JSON.
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


def measure(threads: int | None, chats: int, tokens: int, adapt: bool = False) -> dict:
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

    tick = lambda: None  # noqa: E731
    if adapt:
        from pagedkv.core.thread_share import ThreadShare

        share = ThreadShare(torch.get_num_threads(), torch.set_num_threads, window_s=0.5)
        for _ in range(5):  # an idle server watching the machine before its first request
            time.sleep(0.5)
            share.tick()
        tick = share.tick

    def run(n: int, skip_prefill: bool) -> float:
        for _ in range(n):
            engine.add_request(prompt, params)
        if skip_prefill:
            tick()
            engine.step()
        start = time.perf_counter()
        while engine.has_unfinished():
            tick()
            engine.step()
        return time.perf_counter() - start

    run(1, True)  # warm-up: packs the weights
    batch1 = (tokens - 1) / run(1, True)
    many = chats * tokens / run(chats, False)
    return {"batch1": batch1, "chats": many, "threads": torch.get_num_threads(), "adapt": adapt,
            "wait": {k: os.environ.get(k, "unset") for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}


def child(args: argparse.Namespace, env: dict[str, str], adapt: bool) -> dict:
    cmd = [sys.executable, __file__, "--one", "--chats", str(args.chats), "--tokens", str(args.tokens)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if adapt:
        cmd.append("--adapt")
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
    parser.add_argument("--adapt", action="store_true", help="size the threads between steps (ThreadShare)")
    parser.add_argument("--compare-adapt", action="store_true", help="each round without, then with --adapt")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.threads, args.chats, args.tokens, args.adapt)))
        return 0
    env = dict(item.split("=", 1) for item in args.env)
    variants = [False, True] if args.compare_adapt else [args.adapt]
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for neighbour in (False, True):
            burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
            try:
                time.sleep(0.5 if burner else 0.0)
                for adapt in variants:
                    key = ("neighbour" if neighbour else "quiet") + (" adapt" if adapt else "")
                    results.setdefault(key, []).append(child(args, env, adapt))
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("batch1", "chats")} for k, v in results.items()}
    print(json.dumps({"env": env, "median": med, "raw": results}))
    for adapt in variants:
        tag = " adapt" if adapt else ""
        quiet, busy = med["quiet" + tag], med["neighbour" + tag]
        for m in ("batch1", "chats"):
            ratio = busy[m] / quiet[m]
            print(f"{m}{tag}: quiet {quiet[m]:.1f} tok/s, neighbour {busy[m]:.1f} tok/s, ratio {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
