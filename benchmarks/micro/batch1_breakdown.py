"""Where one batch-1 decode token's time goes (issue 43): SmolLM2, one greedy request at a time, driven through
``Engine.step`` so the prefill step is left out, wall and this thread's CPU time per decode step.

Run: ``.venv/bin/python benchmarks/micro/batch1_breakdown.py [--dtype float32] [--threads 2] [--tokens 96]``.

Parts timed by wrappers on the engine's own objects (their calls nest: the forward holds the layers, the
layers hold attention): scheduler, forward (embedding, fused layer calls, attention + KV write, final norm,
LM head, the rest = the runner's Python: step tensors, metadata, rotary tables), sampling, the scheduler's
update, outputs (detokenize), and what is left of ``step``. Beside it, in the same process: the linears by
kind, each weight multiplied at one row on its own (the fused layer calls hold them; their norms, rotary and
SiLU are the call's time minus its linears'), the step without the wrappers (the same requests run before
they are put in), and the weight-bandwidth floor (the bytes of every weight a
step reads over a 1 GiB torch copy's read + write rate, as issue 43 defines it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common


def copy_bandwidth() -> float:
    """Read + write bytes a second of a 1 GiB copy, best of 5 (the issue's floor uses this rate)."""
    n = 2**28
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * n * 4 / best


def step_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every linear weight a decode step reads (the LM head included; a tied one counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            seen[w.data_ptr()] = w.numel() * w.element_size()
    return sum(seen.values())


def instrument(engine, timers) -> None:  # noqa: ANN001
    model, runner = engine.runner.model, engine.runner
    timers.patch(engine.scheduler, "schedule", "scheduler")
    timers.patch(engine.scheduler, "update_from_output", "scheduler update")
    timers.patch(runner, "execute", "forward")
    timers.patch(engine, "_sample", "sampling")
    timers.patch(engine.outputs, "emit", "outputs/detokenize")
    timers.patch(engine.backend, "attend", "attention")
    timers.patch(engine.backend, "write_kv", "kv write")
    timers.patch(model.model.embed_tokens, "forward", "embedding")
    timers.patch(model.model.norm, "forward", "final norm")
    timers.patch(model.lm_head, "forward", "lm head")
    kernel = runner.layer_kernel
    if kernel is not None:
        timers.patch(kernel, "accepts", "layer checks")
        timers.patch(kernel, "attention_inputs", "layer: norm+qkv+rotary")
        if hasattr(kernel, "queries_into_cache"):  # (the same, writing k/v into the cache: no "kv write" call)
            timers.patch(kernel, "queries_into_cache", "layer: norm+qkv+rotary+kv write")
        timers.patch(kernel, "mlp", "layer: o+norm+mlp")
    else:
        for layer in model.model.layers:
            timers.patch(layer.self_attn, "forward", "layer: attention block (torch)")
            timers.patch(layer.mlp, "forward", "layer: mlp (torch)")


def decode_steps(engine, prompt: list[int], tokens: int, timers, total) -> tuple[int, float, float]:  # noqa: ANN001
    """One greedy request; ``total`` gains what ``timers`` counted in its decode steps (not its prefill).
    Returns (steps, wall s, thread CPU s)."""
    from pagedkv import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0))
    engine.step()  # the prefill
    before = (dict(timers.wall), dict(timers.cpu), dict(timers.calls))
    steps, cpu, wall = 0, time.thread_time(), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    for mine, theirs, old in zip((total.wall, total.cpu, total.calls), (timers.wall, timers.cpu, timers.calls),
                                 before):
        for name, value in theirs.items():
            mine[name] += value - old.get(name, 0)
    return steps, wall, cpu


def linear_kinds(engine, rounds: int) -> dict[str, float]:  # noqa: ANN001
    """ms per step of each kind of linear at one row, every layer's weight of that kind in turn (cold)."""
    from pagedkv.core.model.cpu_linear import packed_linears

    model, runner = engine.runner.model, engine.runner
    kinds = {"q/k/v": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate/up": ("gate_proj", "up_proj"),
             "down": ("down_proj",)}
    layers = model.model.layers
    x = {d: torch.randn(1, 1, d, dtype=model.dtype) for d in {layers[0].mlp.down_proj.in_features,
                                                              model.config.hidden_size}}
    out: dict[str, list[float]] = {k: [] for k in (*kinds, "lm head")}
    with torch.inference_mode(), packed_linears(runner.packed_linears, runner.linear_kernel):
        for _ in range(rounds + 1):
            for kind, names in kinds.items():
                started = time.perf_counter()
                for layer in layers:
                    for name in names:
                        lin = getattr(layer.self_attn if "proj" in name and name[0] in "qkvo" else layer.mlp, name)
                        lin(x[lin.in_features])
                out[kind].append(time.perf_counter() - started)
            started = time.perf_counter()
            model.lm_head(x[model.config.hidden_size])
            out["lm head"].append(time.perf_counter() - started)
    return {k: 1e3 * statistics.median(v[1:]) for k, v in out.items()}


def report(args, engine, timers, runs, kinds, floor_ms) -> None:  # noqa: ANN001
    steps = sum(r[0] for r in runs)
    wall = sum(r[1] for r in runs) / steps * 1e3
    cpu = sum(r[2] for r in runs) / steps * 1e3
    lib = getattr(engine.backend, "lib", None)
    print(f"SmolLM2 {args.dtype}, batch 1, {steps} decode steps over {len(runs)} requests, backend "
          f"{engine.backend.name} isa {getattr(lib, 'isa', '-')}, threads {args.threads}, load "
          f"{os.getloadavg()[0]:.1f}; linear kernel {getattr(engine.runner.linear_kernel, 'name', None)}, "
          f"fused layer {engine.runner.layer_kernel is not None}")
    print(f"step: {wall:.2f} ms wall ({1e3 / wall:.1f} tok/s), {cpu:.2f} ms main-thread CPU; weight floor "
          f"{floor_ms:.2f} ms = {100 * floor_ms / wall:.0f}% of the step")
    print("| part | ms wall / step | ms thread CPU / step | calls / step |\n|---|---|---|---|")
    for name in sorted(timers.wall, key=lambda n: -timers.wall[n]):
        print(f"| {name} | {timers.wall[name] / steps * 1e3:.3f} | {timers.cpu[name] / steps * 1e3:.3f} | "
              f"{timers.calls[name] / steps:.0f} |")
    def per_step(clock: dict, names) -> float:  # noqa: ANN001
        return sum(clock[k] for k in names if k in clock) / steps * 1e3

    step_parts = ("scheduler", "forward", "sampling", "scheduler update", "outputs/detokenize")
    forward_parts = ["embedding", "final norm", "lm head", "layer checks", "layer: norm+qkv+rotary",
                     "layer: norm+qkv+rotary+kv write",
                     "layer: o+norm+mlp", "layer: attention block (torch)", "layer: mlp (torch)"]
    if engine.runner.layer_kernel is not None:  # (otherwise attention is inside the torch layers' own timers)
        forward_parts += ["attention", "kv write"]
    print(f"| rest of step (engine Python) | {wall - per_step(timers.wall, step_parts):.3f} | "
          f"{cpu - per_step(timers.cpu, step_parts):.3f} | |")
    print(f"| rest of forward (runner Python, tensors, rotary tables) | "
          f"{per_step(timers.wall, ['forward']) - per_step(timers.wall, forward_parts):.3f} | "
          f"{per_step(timers.cpu, ['forward']) - per_step(timers.cpu, forward_parts):.3f} | |")
    print("linears alone at one row, ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items())
          + f"; all {sum(kinds.values()):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--requests", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from bench_common import Timers, model_dir

    from pagedkv import LLM

    llm = LLM(model=model_dir(), device="cpu", dtype=args.dtype, block_size=16, kv_cache_memory="256MiB")
    engine = llm.engine
    prompt = engine.encode_prompt("Write a short story about a lighthouse keeper and a storm.")[1]
    timers, total = Timers(), Timers()
    decode_steps(engine, prompt, 8, timers, Timers())  # warm-up: packs the weights
    bare = [decode_steps(engine, prompt, args.tokens, timers, Timers()) for _ in range(args.requests)]
    instrument(engine, timers)
    runs = [decode_steps(engine, prompt, args.tokens, timers, total) for _ in range(args.requests)]
    kinds = linear_kinds(engine, 5)
    floor_ms = step_weight_bytes(engine.runner.model) / copy_bandwidth() * 1e3
    report(args, engine, total, runs, kinds, floor_ms)
    bare_ms = sum(r[1] for r in bare) / sum(r[0] for r in bare) * 1e3
    print(f"without the timers' wrappers (~150 timed calls a step): {bare_ms:.2f} ms wall a step = "
          f"{100 * floor_ms / bare_ms:.0f}% of the weight floor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
