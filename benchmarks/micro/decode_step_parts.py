"""Where a SmolLM2-135M decode step goes, part by part, with each part's own compute floor (issue 20).

Run: ``python benchmarks/micro/decode_step_parts.py [--batch 64] [--rounds 6] [--threads 1]``.

Same setup as ``test_roofline.py`` (``decode_engine``: B sequences with 256 cached tokens each, fp32,
the default backend), and in one process, alternating step by step, the linear layers run two ways:
``mkl`` (plain ``nn.Linear``: torch's MKL sgemm, as before issue 20's decode-step work) and ``onednn``
(the runner's packed weights, :mod:`pagedkv.core.model.cpu_linear`). Every ``nn.Linear`` call is timed by
forward hooks (their own cost lands in "other model ops"), and the attention and KV-write calls by
wrappers. Times are CPU time of this thread (``time.thread_time``), which a 2-core machine shared with
other jobs inflates much less than the wall clock; at 1 thread it is the step's own work. Wall-clock
medians are printed too.

Each part's floor is its FLOPs / the fp32 matmul rate measured in this run with a 2048^3 product, the
``test_roofline.py`` baseline (torch's ``a @ b``, MKL); the same product through oneDNN with a packed
operand is printed beside it, because on this AMD CPU it is faster than MKL's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_common, workload, paged_case

from bench_common import Timers, facts  # noqa: E402
from test_roofline import CTX, decode_engine, model_costs  # noqa: E402


def matmul_rates(n: int = 2048) -> tuple[float, float]:
    """FLOP/s (thread CPU time, best of 5) of an n^3 fp32 product: torch's ``a @ b``, and oneDNN with ``b`` packed."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)
    rates = []
    for fn in (lambda: a @ b, lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")):
        fn()
        best = float("inf")
        for _ in range(5):
            t = time.thread_time()
            fn()
            best = min(best, time.thread_time() - t)
        rates.append(2 * n**3 / best)
    return rates[0], rates[1]


class PartTimer(Timers):
    """CPU seconds per part of the current step: each linear shape, attention, write_kv, the forward, the step."""

    def __init__(self, engine) -> None:
        super().__init__()
        self._start: dict[int, float] = {}
        for module in engine.runner.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(self._pre)
                module.register_forward_hook(self._post)
        backend = engine.runner.backend
        self.patch(backend, "attend", "attention")
        self.patch(backend, "write_kv")
        self.patch(engine.sampler, "sample")
        self.patch(engine.runner, "model", "forward")
        self.step = self.timed(engine.step, "step")

    def _pre(self, module, args) -> None:
        self._start[id(module)] = time.thread_time()

    def _post(self, module, args, out) -> None:
        w = module.weight
        self.cpu[f"linear {w.shape[0]}x{w.shape[1]}"] += time.thread_time() - self._start.pop(id(module))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6, help="timed steps per mode (after one warm-up each)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from pagedkv.core.model.model_loader import load_model

    model, tokenizer, _ = load_model(None, torch.float32, "cpu")
    engine = decode_engine(model, tokenizer, args.batch, CTX, 2 * args.rounds + 2)
    timer = PartTimer(engine)
    mkl_rate, onednn_rate = matmul_rates()
    flops = {f"linear {m.weight.shape[0]}x{m.weight.shape[1]}": 0 for m in model.modules()
             if isinstance(m, torch.nn.Linear)}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            flops[f"linear {m.weight.shape[0]}x{m.weight.shape[1]}"] += 2 * args.batch * m.weight.numel()
    costs = model_costs(model, args.batch, CTX + 1)
    flops["attention"] = costs["flops"] - costs["linear_flops"]
    runs: dict[str, list[dict]] = {"mkl": [], "onednn": []}
    load_before = os.getloadavg()
    for i in range(args.rounds + 1):
        for mode in runs:
            engine.runner.packed_linears = mode == "onednn"
            timer.reset()
            timer.step(stream=False)
            if i:  # the first round of each mode warms up
                runs[mode].append({**timer.cpu, "wall step": timer.wall["step"]})
    print(f"decode step, SmolLM2-135M fp32, batch {args.batch}, ctx {CTX}, {args.threads} thread(s); "
          f"{facts()}; load average before {load_before[0]:.2f}")
    print(f"2048^3 fp32 matmul (thread CPU time): torch/MKL {mkl_rate / 1e9:.1f} GFLOP/s (the floors below), "
          f"oneDNN packed {onednn_rate / 1e9:.1f} GFLOP/s")
    print(f"{'part (median ms)':<24} {'floor':>7} {'mkl':>8} {'%floor':>6} {'onednn':>8} {'%floor':>6}")
    med = {mode: _medians(rows) for mode, rows in runs.items()}
    for part in [*flops, "other model ops", "rest of the model", "sample", "engine (step - forward)", "step",
                 "wall step"]:
        floor = flops[part] / mkl_rate * 1e3 if part in flops else None
        if part == "rest of the model":
            floor = costs["linear_flops"] / mkl_rate * 1e3
        cells = []
        for mode in runs:
            ms = med[mode][part] * 1e3
            pct = f"{100 * floor / ms:>5.0f}%" if floor else f"{'':>6}"
            cells.append(f"{ms:>8.1f} {pct}")
        print(f"{part:<24} {floor if floor else float('nan'):>7.1f} {' '.join(cells)}")
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return 0


def _medians(rows: list[dict]) -> dict[str, float]:
    """Median per part; the derived parts from each step's own numbers."""
    derived = []
    for r in rows:
        linears = sum(v for k, v in r.items() if k.startswith("linear "))
        other = r["forward"] - linears - r.get("attention", 0) - r.get("write_kv", 0)
        derived.append({**r, "other model ops": other, "rest of the model": linears + other,
                        "engine (step - forward)": r["step"] - r["forward"]})
    return {k: statistics.median(d.get(k, 0.0) for d in derived) for k in derived[0]}


if __name__ == "__main__":
    raise SystemExit(main())
