"""Offline batch generation, pagedkv's ``LLM.generate`` against vLLM CPU's ``LLM.generate``, on the same token ids.

    .venv/bin/python benchmarks/e2e/offline_vs_vllm.py                          # 64 prompts x 128 tokens, 2 rounds
    .venv/bin/python benchmarks/e2e/offline_vs_vllm.py --prompts 32 --prompt-len 256 --tokens 64 --rounds 3

Both engines get the same prompts as token ids (drawn from SmolLM2's vocabulary with a fixed seed), greedy,
fp32, ``ignore_eos`` so every engine does the same work, and the same thread count. Each run is a fresh process
(pagedkv in this venv, vLLM in ``$PEERS/vllm/venv``: the two cannot share one), which loads the model, warms up
on one short prompt, then times one ``generate`` over the whole batch; start-up is not counted. Runs alternate
(pagedkv, vLLM, pagedkv, vLLM...) so a shared machine's drift hits both. The table gives output tok/s (median over
rounds), the ratio to vLLM, and how many of the sequences are token-identical to vLLM's (fp32 engines that sum
in different orders may part on a near-tie; the first differing position is given).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case

from bench_common import REPO as ROOT  # noqa: E402
from bench_common import model_dir  # noqa: E402

PEERS = Path(os.environ.get("PEERS", "/tmp/peers"))
VLLM_PYTHON = PEERS / "vllm" / "venv" / "bin" / "python"

# The vLLM side runs in vLLM's own venv: it must not import pagedkv.
VLLM_WORKER = r"""
import json, sys, time


def main():  # vLLM spawns its engine-core process, which re-imports this file: the work must sit under a guard
    job = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"],
              kv_cache_memory_bytes=job["kv_bytes"], enforce_eager=job["eager"], max_num_seqs=job["max_num_seqs"])
    params = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True)
    llm.generate([{"prompt_token_ids": job["prompts"][0][:8]}], SamplingParams(temperature=0.0, max_tokens=4))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    json.dump({"seconds": elapsed, "tokens": tokens}, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
"""

PAGEDKV_WORKER = r"""
import json, sys, time
import torch
job = json.load(open(sys.argv[1]))
torch.set_num_threads(job["threads"])
from pagedkv import LLM, SamplingParams
llm = LLM(job["model"], dtype="float32", backend=job["backend"], max_model_len=job["max_model_len"],
          kv_cache_memory=job["kv_bytes"], max_num_seqs=job["max_num_seqs"])
params = SamplingParams(temperature=0.0, max_tokens=job["tokens"], ignore_eos=True)
llm.generate([{"prompt_token_ids": job["prompts"][0][:8]}], SamplingParams(temperature=0.0, max_tokens=4))
start = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params)
elapsed = time.perf_counter() - start
json.dump({"seconds": elapsed, "tokens": [list(o.outputs[0].token_ids) for o in outs]}, open(sys.argv[2], "w"))
"""


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def _run(label: str, python: str, worker: str, job: dict, env: dict[str, str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="pagedkv-offline-") as tmp:
        job_file, out_file, script = Path(tmp, "job.json"), Path(tmp, "out.json"), Path(tmp, "worker.py")
        job_file.write_text(json.dumps(job))
        script.write_text(worker)
        load = os.getloadavg()[0]
        done = subprocess.run([python, str(script), str(job_file), str(out_file)], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=timeout, cwd=tmp)
        if done.returncode != 0 or not out_file.exists():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-60:])
            raise SystemExit(f"{label} failed (rc {done.returncode}):\n{tail}")
        result = json.loads(out_file.read_text())
        result["load"] = load
        return result


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--backend", default="auto", help="pagedkv backend (auto, cpu, torch)")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile (--enforce-eager)")
    parser.add_argument("--kv-bytes", type=int, default=2 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        print(f"vLLM is not installed ({VLLM_PYTHON} missing; /work/shared/peers/vllm_install.sh): nothing to compare")
        return 0
    model = model_dir()
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    job = {"model": model, "prompts": _prompts(args.prompts, args.prompt_len, vocab, args.seed),
           "tokens": args.tokens, "threads": args.threads, "backend": args.backend, "eager": args.eager,
           "max_model_len": args.prompt_len + args.tokens + 16, "kv_bytes": args.kv_bytes,
           "max_num_seqs": max(args.prompts, 1)}
    vllm_env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_TARGET_DEVICE": "cpu",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    sides = {"pagedkv": (str(ROOT / ".venv" / "bin" / "python"), PAGEDKV_WORKER, {}),
             "vllm": (str(VLLM_PYTHON), VLLM_WORKER, vllm_env)}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name, (python, worker, env) in sides.items():
            started = time.perf_counter()
            result = _run(name, python, worker, job, env, args.timeout)
            runs[name].append(result)
            print(f"round {round_ + 1} {name}: {result['seconds']:.1f} s generate "
                  f"({time.perf_counter() - started:.0f} s with start-up), load {result['load']:.1f}", flush=True)
    total = args.prompts * args.tokens
    reference = runs["vllm"][-1]["tokens"]
    rows = []
    for name, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        diffs = [_first_difference(a, b) for a, b in zip(results[-1]["tokens"], reference)]
        rows.append({"engine": name, "tok_s": total / seconds, "seconds": seconds,
                     "identical": sum(d is None for d in diffs),
                     "first_diffs": sorted(d for d in diffs if d is not None),
                     "load": statistics.mean(r["load"] for r in results)})
    vllm_rate = next(r["tok_s"] for r in rows if r["engine"] == "vllm")
    print(f"\n{args.prompts} prompts x {args.prompt_len} tokens, {args.tokens} generated each, greedy fp32, "
          f"{args.threads} threads, vLLM {'eager' if args.eager else 'compiled'}, pagedkv backend {args.backend}")
    print(f"{'engine':<10}{'tok/s':>9}{'x vLLM':>8}{'identical':>11}  first differing positions   load")
    for row in rows:
        row["x_vllm"] = row["tok_s"] / vllm_rate
        print(f"{row['engine']:<10}{row['tok_s']:>9.1f}{row['x_vllm']:>8.2f}{row['identical']:>6}/{args.prompts:<4}"
              f"  {str(row['first_diffs'][:8]):<26}{row['load']:>5.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
