"""Where an engine step's time goes on this CPU: scheduler, model forward by op family, attention, sampling,
outputs (detokenization), for the 32-chat workload of e2e/chat_backends.py through ``LLM.generate``.

Run: ``.venv/bin/python benchmarks/micro/step_breakdown.py [--threads N] [--backend auto] [--requests 32]``.

The engine-level parts are timed by wrappers around ``scheduler.schedule``, ``runner.execute``, the
engine's ``_sample`` and ``outputs.emit`` (wall clock). Inside the forward, ``torch.profiler`` gives the self
CPU time of every aten op, summed into families (linear = addmm/mm/linear/matmul and the packed oneDNN
linear; elementwise; norm; rotary/index; copies and views), and attention is the backend's ``attend``
calls (a ``record_function`` range, so its C kernel time is not counted under any aten op). The profiler
adds a little per op; the shares are what it is for.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case

FAMILIES = {
    "linear": ("addmm", "mm", "linear", "matmul", "bmm", "mkldnn", "_linear"),
    "elementwise": ("mul", "add", "silu", "sigmoid", "neg", "div", "sub", "exp", "tanh", "pow", "rsqrt", "mean",
                    "cat", "where", "masked_fill"),
    "copy/view/index": ("copy_", "to", "view", "reshape", "index", "select", "slice", "contiguous", "empty",
                        "transpose", "expand", "clone", "embedding", "unsqueeze", "_unsafe_view", "as_strided",
                        "t", "zeros", "full", "arange", "repeat", "stack"),
}


def family(op: str) -> str:
    name = op.removeprefix("aten::").removeprefix("mkldnn::").removeprefix("pagedkv::")
    for fam, keys in FAMILIES.items():
        if name in keys or any(name.startswith(k + "_") for k in keys if len(k) > 3):
            return fam
    return "other aten"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from bench_common import Timers, model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from workload import build_workload

    from pagedkv import LLM, SamplingParams

    path = model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    work = build_workload(tokenizer, num_requests=args.requests)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(hf_model=model, tokenizer=tokenizer, device="cpu", backend=args.backend, block_size=16,
              kv_cache_memory="1GiB")
    engine = llm.engine
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in work.max_tokens]
    llm.generate(work.prompt_ids[:2], params[:2])  # warm-up

    timers = Timers()
    wall = timers.wall
    timers.patch(engine.scheduler, "schedule", "scheduler")
    timers.patch(engine.runner, "execute", "forward (all)")
    timers.patch(engine, "_sample", "sampling")
    timers.patch(engine.outputs, "emit", "outputs/detokenize")
    timers.patch(engine.backend, "attend", "attention", record="attention")
    timers.patch(engine.backend, "write_kv", "kv write", record="kv write")

    from torch.profiler import ProfilerActivity, profile

    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outs = llm.generate(work.prompt_ids, params)
    total = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in outs)
    fams = collections.Counter()
    for ev in prof.key_averages():
        if ev.key in ("attention", "kv write"):
            continue
        fams[family(ev.key)] += ev.self_cpu_time_total / 1e6
    inner = sum(fams.values())
    forward = wall["forward (all)"]
    in_forward = forward - wall["attention"] - wall["kv write"]
    print(f"{args.requests} chats, {tokens} tokens in {total:.2f} s ({tokens / total:.1f} tok/s, profiled), "
          f"{engine.stats.steps} steps, backend {engine.backend.name} "
          f"{getattr(engine.backend, 'routes', '')} isa {getattr(getattr(engine.backend, 'lib', None), 'isa', '-')}, "
          f"threads {args.threads}, load {os.getloadavg()[0]:.1f}")
    print("| part | s | share of the run |\n|---|---|---|")
    rows = [("scheduler", wall["scheduler"]), ("sampling", wall["sampling"]),
            ("outputs/detokenize", wall["outputs/detokenize"]), ("attention", wall["attention"]),
            ("kv write", wall["kv write"])]
    for fam, secs in fams.most_common():  # the forward outside attention, split by the profiler's shares
        rows.append((f"forward: {fam}", in_forward * secs / inner if inner else 0.0))
    rows.append(("rest (engine bookkeeping, Python)", total - sum(wall[k] for k in wall if k != "attention"
                                                                   and k != "kv write")))
    for name, secs in rows:
        print(f"| {name} | {secs:.2f} | {100 * secs / total:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
