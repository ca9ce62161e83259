"""Weight bandwidth of the cpu backend's linears at batch 1 and 4 on SmolLM2-135M's shapes (k = 576; n = 576, 192,
1536, 49152): fp32 (``linear.h``) and the GGUF-block formats Q8_0 / Q4_0 / Q4_1 (``quant_linear.h``), each as the
weight bytes a call reads over its wall time, with the copy bandwidth measured in the same process as the floor.

Each kernel cycles through enough copies of its weight (>= ``--pool-mb``, past the last-level cache) that every call
reads its weight from memory, as a decode step does. The weights go through ``QuantLinear`` so the script reads the
layout the engine holds (the file's or a repacked one): the same script measures before and after a layout change.

    .venv/bin/python benchmarks/micro/quant_bandwidth.py [--threads 1] [--rows 1,4] [--calls 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

SHAPES = [(576, 576), (192, 576), (1536, 576), (49152, 576)]  # (n, k)
FORMATS = ("fp32", "Q8_0", "Q4_0", "Q4_1")


def copy_bandwidth(mb: int, rounds: int = 5) -> float:
    """GB/s read by a ``copy_`` of ``mb`` MB (the best of ``rounds``; a copy also writes as many bytes)."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return src.numel() * 4 / best / 1e9


def weights(fmt: str, n: int, k: int, pool_mb: int, fp32_kernel, rng) -> tuple[list[torch.Tensor], int]:  # noqa: ANN001
    """Copies of one random weight (as the kernel reads it) filling ``pool_mb``, and one copy's bytes."""
    import gguf

    from pagedkv.core.model.quant_linear import QuantLinear

    w = rng.standard_normal((n, k), dtype=np.float32)
    if fmt == "fp32":
        one = fp32_kernel.pack(torch.from_numpy(w))
    else:
        blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt]))
        one = QuantLinear(blocks, fmt, k, n).blocks
    size = one.numel() * one.element_size()
    copies = max(2, -(-pool_mb * 2**20 // size))
    return [one.clone() for _ in range(copies)], size


def measure(fmt: str, n: int, k: int, rows: int, args, kernels, rng) -> float:  # noqa: ANN001
    """Median GB/s of ``args.rounds`` rounds of ``args.calls`` calls, each on the next copy of the weight."""
    fp32, quant = kernels
    pool, size = weights(fmt, n, k, args.pool_mb, fp32, rng)
    x = torch.randn(rows, k)

    def call(w: torch.Tensor) -> None:
        if fmt == "fp32":
            fp32.linear(x, w, None, n)
        else:
            quant.linear(x, w, fmt, n)

    for w in pool[:2]:
        call(w)
    seen = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        for i in range(args.calls):
            call(pool[i % len(pool)])
        seen.append(size * args.calls / (time.perf_counter() - started) / 1e9)
    del pool
    return statistics.median(seen)


def main() -> None:
    from pagedkv.backends.cpu import build
    from pagedkv.backends.cpu.linear import CpuLinearKernel
    from pagedkv.backends.cpu.quant_linear import CpuQuantKernel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pool-mb", type=int, default=96)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--isa", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = build.load(args.isa)
    kernels = (CpuLinearKernel(lib), CpuQuantKernel(lib))
    rng = np.random.default_rng(0)
    result = {"isa": lib.isa, "threads": args.threads, "copy_gbs": copy_bandwidth(256), "kernels": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        for fmt in args.formats.split(","):
            for n, k in SHAPES:
                gbs = measure(fmt, n, k, rows, args, kernels, rng)
                result["kernels"][f"{fmt} rows={rows} n={n} k={k}"] = gbs
    result["copy_gbs_after"] = copy_bandwidth(256)
    if args.json:
        print(json.dumps(result))
        return
    floor = (result["copy_gbs"] + result["copy_gbs_after"]) / 2
    print(f"isa {result['isa']}, {args.threads} threads, copy {floor:.1f} GB/s read, {2 * floor:.1f} GB/s read + "
          f"written (before/after {result['copy_gbs']:.1f}/{result['copy_gbs_after']:.1f})")
    for key, gbs in result["kernels"].items():
        print(f"{key:32s} {gbs:7.2f} GB/s  {gbs / floor:5.2f}x copy")


if __name__ == "__main__":
    main()
