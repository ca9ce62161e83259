"""One SmolLM2-135M layer's prefill attention through the cpu kernel (``prefill.h``), this tree against another
tree's kernel and torch's flash SDPA, alternating round by round in one process.

    .venv/bin/python benchmarks/micro/prefill_ab.py
    git worktree add /tmp/ref HEAD~1
    .venv/bin/python benchmarks/micro/prefill_ab.py --ref /tmp/ref --rounds 12

Cases: one 2,048-token prompt and eight 256-token prompts (9 query heads, 3 KV heads, head dim 64, fp32,
block size 16, block tables shuffled over the pool), the whole prompt in one step, causal. The kernels are
called through ``CpuBackend.attend`` on one thread, beside ``--backend torch`` (the reference, whose prefill
gathers each prompt's K/V and runs SDPA); plain SDPA gets the same Q/K/V contiguous, per prompt, with
``is_causal`` and ``enable_gqa``. Times are this thread's CPU time (``time.thread_time``: what other processes
took of the core is left out); GF/s counts the causal Q.K and P.V multiply-adds only. "x ref" is the
reference's median over this tree's, from the same minutes. Every output is checked against SDPA first.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case

from linear_ab import compile_tree  # noqa: E402  (beside this file)
from paged_case import BLOCK, HEAD_DIM, HEADS, KV_HEADS, random_paged_cache  # noqa: E402

from pagedkv.backends.cpu import CpuBackend, build
from pagedkv.backends.cpu.route_table import TORCH, Routes
from pagedkv.backends.torch_ref import TorchBackend
from pagedkv.core.kv.attention_metadata import AttentionMetadata

CASES = {"1x2048": (1, 2048), "8x256": (8, 256)}


def make_case(batch: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = random_paged_cache(batch, length, gen)
    meta = AttentionMetadata.build(block_tables=tables.tolist(), context_lens=[0] * batch,
                                   query_lens=[length] * batch, block_size=BLOCK)
    query = torch.randn(batch * length, HEADS, HEAD_DIM, generator=gen)
    # the same K/V contiguous, [batch, kv_heads, length, dim], for SDPA
    keys = k_cache[tables].reshape(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    values = v_cache[tables].reshape(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    return query, k_cache, v_cache, meta, keys, values


def sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    batch, length = keys.shape[0], keys.shape[2]
    q = query.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(batch * length, HEADS, HEAD_DIM)


def time_case(name: str, kernels: dict[str, CpuBackend], rounds: int) -> None:
    """Check every kernel against SDPA on case ``name``, then time them alternately and print the table."""
    batch, length = CASES[name]
    query, k_cache, v_cache, meta, keys, values = make_case(batch, length)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    reference = TorchBackend("cpu")
    by_torch = CpuBackend(build.load(), routes=Routes(prefill=TORCH))
    runs = {key: (lambda b=b: b.attend(query, k_cache, v_cache, meta, scale)) for key, b in kernels.items()}
    runs["torch backend"] = lambda: reference.attend(query, k_cache, v_cache, meta, scale)
    runs["cpu, prefill route torch"] = lambda: by_torch.attend(query, k_cache, v_cache, meta, scale)
    runs["sdpa"] = lambda: sdpa(query, keys, values, scale)
    expected = runs["sdpa"]().double()
    for key, fn in runs.items():
        torch.testing.assert_close(fn().double(), expected, atol=5e-5, rtol=5e-5, msg=lambda m, k=key: f"{k}: {m}")
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(rounds):
        for key, fn in runs.items():
            started = time.thread_time()
            fn()
            times[key].append(time.thread_time() - started)
    flops = 2 * 2 * batch * HEADS * HEAD_DIM * length * (length + 1) / 2  # Q.K and P.V, causal
    ref = statistics.median(times["ref"]) if "ref" in times else None
    print(f"\n{name} ({build.best_isa()}, 1 thread, {rounds} rounds)")
    print("| kernel | best ms | median ms | GF/s (median) | x ref |")
    print("|---|---|---|---|---|")
    for key, ts in times.items():
        med = statistics.median(ts)
        ratio = f"{ref / med:.2f}" if ref else "-"
        print(f"| {key} | {min(ts) * 1e3:.1f} | {med * 1e3:.1f} | {flops / med / 1e9:.1f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ref", type=Path, default=None, help="another checkout whose kernel to compare")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"this": CpuBackend(build.load())}
        if args.ref is not None:
            kernels["ref"] = CpuBackend(compile_tree(args.ref, Path(tmp)))
        for name in args.case or sorted(CASES):
            time_case(name, kernels, args.rounds)


if __name__ == "__main__":
    main()
