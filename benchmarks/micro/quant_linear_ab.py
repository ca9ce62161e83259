"""The cpu backend's linear on GGUF blocks (``quant_linear.h``) against its fp32 packed linear (``linear.h``) on
SmolLM2-135M's shapes: one layer's seven products (Q4_1) and the tied ``lm_head`` (Q8_0), random weights, one
thread, at 1 / 8 / 32 rows. Times are this thread's CPU seconds (a shared machine's other work does not count;
memory stalls do), medians of alternated rounds.

    .venv/bin/python benchmarks/micro/quant_linear_ab.py [--rounds 7] [--rows 1,8,32] [--isa avx512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

# (out, in, format) of one SmolLM2 layer's q, k, v, o, gate, up, down, then lm_head
SHAPES = [(576, 576, "Q4_1"), (192, 576, "Q4_1"), (192, 576, "Q4_1"), (576, 576, "Q4_1"), (1536, 576, "Q4_1"),
          (1536, 576, "Q4_1"), (576, 1536, "Q4_1"), (49152, 576, "Q8_0")]


def main() -> None:
    import gguf

    from pagedkv.backends.cpu import build
    from pagedkv.backends.cpu.linear import CpuLinearKernel
    from pagedkv.backends.cpu.quant_linear import CpuQuantKernel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--isa", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lib = build.load(args.isa)
    quant, fp32 = CpuQuantKernel(lib), CpuLinearKernel(lib)
    rng = np.random.default_rng(0)
    weights = []
    for n, k, qtype in SHAPES:
        w = rng.standard_normal((n, k), dtype=np.float32)
        blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]))
        weights.append((n, k, qtype, blocks, fp32.pack(torch.from_numpy(w))))
    print(f"isa {lib.isa}, one thread, CPU ms (median of {args.rounds})")
    for rows in (int(r) for r in args.rows.split(",")):
        for label, picked in (("layer x7", weights[:7]), ("lm_head", weights[7:])):
            xs = [torch.randn(rows, k) for _, k, *_ in picked]
            seen: dict[str, list[float]] = {"blocks": [], "fp32": []}
            for _ in range(args.rounds):
                started = time.thread_time()
                for x, (n, _, qtype, blocks, _) in zip(xs, picked):
                    quant.linear(x, blocks, qtype, n)
                seen["blocks"].append(time.thread_time() - started)
                started = time.thread_time()
                for x, (n, _, _, _, packed) in zip(xs, picked):
                    fp32.linear(x, packed, None, n)
                seen["fp32"].append(time.thread_time() - started)
            q, f = (statistics.median(seen[name]) * 1e3 for name in ("blocks", "fp32"))
            print(f"rows {rows:3d} {label:9s} blocks {q:8.3f}  fp32 {f:8.3f}  fp32/blocks {f / q:5.2f}x")


if __name__ == "__main__":
    main()
