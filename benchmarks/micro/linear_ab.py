"""SmolLM2-135M's linear layers through the cpu kernel's packed fp32 linear (``linear.h``), this tree against
another tree's kernel and torch's ``F.linear`` (MKL), alternating round by round in one process.

    .venv/bin/python benchmarks/micro/linear_ab.py --rows 1 --rows 16 --rows 32 --rows 60 --rows 1280
    git worktree add /tmp/ref HEAD~1
    .venv/bin/python benchmarks/micro/linear_ab.py --ref /tmp/ref --rows 32 --threads 2 --rounds 12

Each round multiplies ``--rows`` rows by all 30 layers' ``[Wq;Wk;Wv]``, ``o_proj``, ``[Wg;Wu]`` and
``down_proj`` weights (random, 425 MB a copy: more than any L3, so every weight comes from memory as in an
engine step) and, with ``--lm-head``, the 49,152-row tied head. The kernels are called directly (ctypes, into
preallocated outputs), without the engine around them. ``--ref`` compiles that tree's
``backends/cpu`` sources with this tree's flags for this CPU's best instruction set. The table gives
the best and median time of a round and GF/s; "x ref" is the reference's median over this tree's (a ratio
from the same minutes, which is what a shared machine allows).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.linear import CpuLinearKernel

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of SmolLM2-135M's four linears
LAYERS, HEAD = 30, (49152, 576)


def compile_tree(tree: Path, out_dir: Path) -> ctypes.CDLL:
    """``tree``'s kernel, built like this tree's for this CPU's best instruction set."""
    isa = build.best_isa()
    target = out_dir / f"ref_{isa}.so"
    src = tree / "backends" / "cpu"  # an older tree has attention.cpp alone, holding every entry point
    units = [str(src / name) for name in build.SOURCES if (src / name).exists()]
    cmd = [build.compiler() or "g++", *build.FLAGS, *build.march(isa), *units, "-o", str(target)]
    print(f"compiling {tree}'s kernel ({isa})...", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    lib = build._bind(ctypes.CDLL(str(target)))
    lib.isa = isa
    return lib


def direct_call(kernel: CpuLinearKernel, x: torch.Tensor, packed: torch.Tensor, n: int, y: torch.Tensor,
                threads: int):  # noqa: ANN201 - a closure
    """``y[:, :n] = x W^T`` by ``kernel``, as one ctypes call with every argument ready."""
    fn, rows, k = kernel.lib.pagedkv_cpu_linear, x.shape[0], x.shape[1]
    xp, pp, yp = ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(packed.data_ptr()), ctypes.c_void_p(y.data_ptr())

    def call() -> None:
        if fn(xp, rows, k, pp, None, n, yp, threads) != 0:
            raise RuntimeError(f"the kernel rejected {rows} x {k} -> {n}")
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, action="append", help="rows of x (default 1, 8, 32, 60, 240)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ref", type=Path, default=None, help="another checkout whose kernel to compare")
    parser.add_argument("--lm-head", action="store_true", help="also the 49,152 x 576 head")
    parser.add_argument("--no-mkl", action="store_true", help="leave torch's F.linear out (it is slow to run)")
    args = parser.parse_args()
    rows_list = args.rows or [1, 8, 32, 60, 240]
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER * LAYERS + ([HEAD] if args.lm_head else [])
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]

    kernels = {"this": CpuLinearKernel(build.load())}
    with tempfile.TemporaryDirectory() as tmp:
        if args.ref is not None:
            kernels["ref"] = CpuLinearKernel(compile_tree(args.ref.resolve(), Path(tmp)))
        packed = {name: [k.pack(w) for w in weights] for name, k in kernels.items()}
        for name, kernel in kernels.items():
            if kernel.panel != kernels["this"].panel:
                raise SystemExit(f"{name}'s panel is {kernel.panel}, this tree's {kernels['this'].panel}")

        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; isa {kernels['this'].lib.isa}; "
              f"threads {args.threads}; {len(shapes)} matrices; rounds {args.rounds}")
        print("| rows | kernel | best ms | median ms | GF/s (median) | x ref |")
        print("|---|---|---|---|---|---|")
        for rows in rows_list:
            xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
            flops = sum(2.0 * rows * n * k for n, k in shapes)
            y = torch.empty(rows, max(n for n, _ in shapes))
            calls = {name: [direct_call(kernel, xs[w.shape[1]], p, w.shape[0], y, args.threads)
                            for w, p in zip(weights, packed[name])] for name, kernel in kernels.items()}
            runs = {name: [] for name in [*kernels, *([] if args.no_mkl else ["mkl"])]}
            for _ in range(args.rounds):
                for name in runs:
                    started = time.perf_counter()
                    if name == "mkl":
                        for w in weights:
                            F.linear(xs[w.shape[1]], w)
                    else:
                        for call in calls[name]:
                            call()
                    runs[name].append(time.perf_counter() - started)
            medians = {name: statistics.median(t) for name, t in runs.items()}
            for name, times in runs.items():
                ratio = f"{medians['ref'] / medians[name]:.3f}" if "ref" in medians else ""
                print(f"| {rows} | {name} | {min(times) * 1e3:.2f} | {medians[name] * 1e3:.2f} | "
                      f"{flops / medians[name] * 1e-9:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
