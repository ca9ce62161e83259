"""Decode attention of one SmolLM2 layer on the ``cpu`` backend: an int8 KV cache against fp32 (issue 29).

9 query / 3 KV heads, head dim 64, block 16, batch 64, one decode token per sequence, block tables shuffled
over the pool; the int8 cache holds the fp32 cache's rows quantized (``core/kv/kv_dtype.py``). ``--threads``
torch threads (default 1); the rows are timed in interleaved rounds (fp32, int8, fp32, ...: a neighbour's
burst hits both alike), per call the median of ``--rounds`` by the process's CPU clock (``time.process_time``:
all the kernel's threads, and not tick-rounded as ``getrusage`` is here; on a shared machine the wall clock
measures the neighbours) and by the wall clock. The load average is printed before and after: a verdict
needs a quiet machine. Also the torch reference on the int8 cache (dequantize in the gather), the path every
other 8-bit case takes.

    .venv/bin/python benchmarks/micro/kv_quant_decode.py --ctx 2048 --batch 64 --rounds 7 --no-reference
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case

from bench_common import interleaved_medians  # noqa: E402
from paged_case import BLOCK, HEAD_DIM, HEADS, random_paged_cache  # noqa: E402

from pagedkv.backends.cpu.backend import CpuBackend
from pagedkv.backends.torch_ref import TorchBackend
from pagedkv.core.kv.attention_metadata import AttentionMetadata
from pagedkv.core.kv.kv_dtype import quantize_rows


def case(ctx: int, batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k, v, tables = random_paged_cache(batch, ctx, gen)
    meta = AttentionMetadata.build(block_tables=tables.tolist(), context_lens=[ctx - 1] * batch,
                                   query_lens=[1] * batch, block_size=BLOCK)
    return torch.randn(batch, HEADS, HEAD_DIM, generator=gen), k, v, meta


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads")
    parser.add_argument("--no-reference", action="store_true", help="skip the (slow) torch reference row")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    query, k, v, meta = case(args.ctx, args.batch)
    k8, v8 = quantize_rows(k, torch.int8), quantize_rows(v, torch.int8)
    cpu, ref = CpuBackend(), TorchBackend("cpu")
    scale = HEAD_DIM**-0.5
    rows = {
        "cpu fp32": (lambda: cpu.attend(query, k, v, meta, scale), k.numel() * 2 * 4),
        "cpu int8": (lambda: cpu.attend(query, k8, v8, meta, scale), k8.numel() * 2),
    }
    if not args.no_reference:
        rows["torch int8 (reference)"] = (lambda: ref.attend(query, k8, v8, meta, scale), k8.numel() * 2)
    err = (cpu.attend(query, k8, v8, meta, scale) - cpu.attend(query, k, v, meta, scale)).abs().max().item()
    print(f"decode attention, ctx {args.ctx}, batch {args.batch}, 9/3 heads x 64, block 16, {args.threads} "
          f"thread(s), median of {args.rounds} interleaved rounds; max |int8 - fp32| of the output {err:.2e}; "
          f"isa {getattr(cpu.lib, 'isa', '?')}; load average before {load_average()}")
    times = interleaved_medians(rows, args.rounds)
    base_cpu, base_wall = times["cpu fp32"]
    for name, (_, nbytes) in rows.items():
        cpu_s, wall_s = times[name]
        print(f"{name:<24} {cpu_s * 1e3:9.2f} ms cpu {wall_s * 1e3:9.2f} ms wall  {nbytes / 2**20:8.1f} MiB K/V  "
              f"{base_cpu / cpu_s:5.2f}x fp32 (cpu time) {base_wall / wall_s:5.2f}x (wall)")
    print(f"load average after {load_average()}")


if __name__ == "__main__":
    main()
