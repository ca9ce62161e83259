"""A/B of the cpu backend's fused-layer wrapper (``backends/cpu/llama_layers.py``) against another version of that
file, in one process on one library (issue 43, batch 1): SmolLM2's 30 layers x (accepts, attention_inputs, mlp) at
one row per "step", a new cos/sin pair each step as the model makes them; alternated rounds, medians.

Run: ``git show OLD:backends/cpu/llama_layers.py > /tmp/old_layers.py`` then
``.venv/bin/python benchmarks/micro/layer_wrapper_ab.py /tmp/old_layers.py --dtype bfloat16``.
One thread and this thread's CPU time by default: on a shared machine the wall time of a 2-thread step is mostly
the neighbours' (the wrapper's Python cost is main-thread CPU either way)."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common


def load_old(path: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("old_llama_layers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_llama_layers"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("old", help="another version of backends/cpu/llama_layers.py")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--wall", action="store_true", help="wall time instead of this thread's CPU time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from bench_common import model_dir

    from pagedkv import LLM

    clock = time.perf_counter if args.wall else time.thread_time
    engine = LLM(model=model_dir(), device="cpu", dtype=args.dtype, block_size=16, kv_cache_memory="64MiB").engine
    new = engine.runner.layer_kernel
    old = load_old(args.old).CpuLlamaLayers(new.lib, new.linear)
    layers, dtype = engine.runner.model.model.layers, getattr(torch, args.dtype)
    h0, attn = torch.randn(1, 1, 576).to(dtype), torch.randn(1, 9, 64).to(dtype)

    def step(kernel) -> torch.Tensor:  # noqa: ANN001
        h, emb = h0.clone(), torch.randn(1, 1, 64)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        for layer in layers:
            kernel.accepts(layer, h)
            kernel.attention_inputs(layer, h, cos, sin)
            h = kernel.mlp(layer, h, attn)
        return h

    times: dict[str, list[float]] = {"old": [], "new": []}
    with torch.inference_mode():
        torch.manual_seed(0)
        a = step(old)
        torch.manual_seed(0)
        assert torch.equal(a, step(new)), "the two wrappers disagree"
        for r in range(args.rounds):
            order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
            for name, kernel in order:
                samples = []
                for _ in range(20):
                    started = clock()
                    step(kernel)
                    samples.append(clock() - started)
                times[name].append(statistics.median(samples))
    o, n = statistics.median(times["old"]), statistics.median(times["new"])
    print(f"{args.dtype}, {args.threads} thread(s), {'wall' if args.wall else 'thread CPU'}: 30 layers' fused calls "
          f"a step, median of {args.rounds} alternated rounds x 20 steps: old {o * 1e3:.3f} ms, new {n * 1e3:.3f} ms, "
          f"new/old {n / o:.3f}, saved {1e3 * (o - n):.3f} ms")
    print("per-round new/old:", [round(b / a, 3) for a, b in zip(times["old"], times["new"])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
