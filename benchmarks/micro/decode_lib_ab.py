"""Decode attention of two builds of the CPU kernel library side by side: fp32, bf16 and int8 caches (issue 43).

Loads two library files (e.g. main's ``pagedkv_cpu_attention_<isa>_<key>.so`` from the cache and a branch's),
checks their outputs are bit for bit the same, and times each cache format in interleaved rounds (A, B, A, ...:
a neighbour's burst hits both alike), by the process's CPU clock; ``--repeats`` such medians give the A/B
ratios. SmolLM2's layer shape (9/3 heads x 64, block 16), one decode token per sequence, 1 thread.

    .venv/bin/python benchmarks/micro/decode_lib_ab.py A.so B.so --ctx 2048 --batch 64 --rounds 7 --repeats 5
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, paged_case

from bench_common import interleaved_medians  # noqa: E402
from paged_case import BLOCK, HEAD_DIM, HEADS, random_paged_cache  # noqa: E402

from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.backend import CpuBackend
from pagedkv.core.kv.attention_metadata import AttentionMetadata
from pagedkv.core.kv.kv_dtype import quantize_rows


def backend(path: str) -> CpuBackend:
    lib = build._bind(ctypes.CDLL(path))
    lib.isa = build.best_isa()
    return CpuBackend(lib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    k, v, tables = random_paged_cache(args.batch, args.ctx, gen)
    meta = AttentionMetadata.build(block_tables=tables.tolist(), context_lens=[args.ctx - 1] * args.batch,
                                   query_lens=[1] * args.batch, block_size=BLOCK)
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen)
    cases = {"fp32": (q, k, v), "bf16": (q.bfloat16(), k.bfloat16(), v.bfloat16()),
             "int8": (q, quantize_rows(k, torch.int8), quantize_rows(v, torch.int8))}
    libs = {"A": backend(args.a), "B": backend(args.b)}
    scale = HEAD_DIM**-0.5
    for name, (query, kc, vc) in cases.items():
        same = torch.equal(*(b.attend(query, kc, vc, meta, scale) for b in libs.values()))
        rows = {n: ((lambda b=b, c=(query, kc, vc): b.attend(*c, meta, scale)), None) for n, b in libs.items()}
        ratios, last = [], {}
        for _ in range(args.repeats):
            last = interleaved_medians(rows, args.rounds)
            ratios.append(last["A"][0] / last["B"][0])
        print(f"{name}: bit-identical {same}; A {last['A'][0] * 1e3:.2f} ms, B {last['B'][0] * 1e3:.2f} ms cpu; "
              f"A/B {[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
