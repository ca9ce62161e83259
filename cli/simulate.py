"""The ``engine simulate`` command line: arguments, setup from them, and the run."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pagedkv.core.output_files import check_output_paths
from pagedkv.sim.model_budget import format_gib, gpu_kv_budget, load_model_config, weight_bytes_per_param
from pagedkv.sim.report import format_report, jsonable
from pagedkv.sim.simulate import SWEEP_KEYS, SimSetup, default_step_time, parse_sweep, simulate

# --- the command line (``engine simulate``; cli/main.py adds the subparser and dispatches here) --------------------


def add_arguments(p: Any) -> None:
    p.add_argument("--workload", default="sharegpt",
                   help="sharegpt, alpaca, shared-prefix, a requests .jsonl, or a trace from `engine run --trace`")
    p.add_argument("--num-requests", type=int, default=1000, help="for a built-in workload (default 1000)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-config", default=None, help="HF config.json (or its dir) for the KV shape; "
                   "default: SmolLM2-135M's shape")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", default=None, help="KV budget in bytes (e.g. 40GiB)")
    budget.add_argument("--num-blocks", type=int, default=None, help="KV budget in blocks")
    budget.add_argument("--gpu-memory", default=None,
                        help="plan for a GPU of this size (e.g. 80GiB): KV = size x utilization - weights")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="with --gpu-memory (default 0.9)")
    p.add_argument("--num-params", type=float, default=None, help="with --gpu-memory: override the params estimate")
    p.add_argument("--dtype", default="bfloat16", help="KV and weight dtype size: bfloat16/float16 (2), float32 (4)")
    p.add_argument("--quantization", "-q", default=None,
                   help="weights as engine run's --quantization: int8 (Q8_0, 1.0625 B a weight), int4 (Q4_1, "
                   "0.625 B), or a GGUF block format q8_0/q4_0/q4_1: the weight bytes --gpu-memory subtracts and "
                   "a decode step reads (default: --dtype)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV storage: auto (= --dtype), bfloat16, float16, int8, fp8_e4m3, fp8_e5m2")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--swap-space", default=None, help="CPU swap space, e.g. 4GiB (its pool is allocated on CPU)")
    p.add_argument("--step-time", default=None, metavar="K=V,...",
                   help="fixed_ms, prefill_us_per_token, decode_us_per_seq, context_ns_per_token")
    p.add_argument("--calibrate", default=None, metavar="TRACE", help="fit the step-time model to a recorded trace")
    p.add_argument("--no-static", action="store_true", help="skip the static max-length allocator's run")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"a table over one setting ({', '.join(SWEEP_KEYS)}); repeatable")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="plot KV blocks in use over simulated time, paged vs static (.png/.svg/.pdf)")
    p.add_argument("--trace", default=None, metavar="FILE", help="record the paged run for `engine monitor --replay`")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    p.add_argument("--no-decode-lane", action="store_true",
                   help="step every sequence one by one (same results, slower; for plugins that read other sequences)")


def setup_from_args(args: Any) -> tuple[SimSetup, dict]:
    from pagedkv.core.config import parse_bytes

    cfg = load_model_config(args.model_config)
    if args.num_params:
        cfg._sim_num_params = int(args.num_params)
    setup = SimSetup(
        model_config=cfg, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
        swap_space=args.swap_space, trace=args.trace, quantization=args.quantization,
        decode_lane=not args.no_decode_lane,
    )
    per_param = weight_bytes_per_param(args.dtype, args.quantization)  # a bad --dtype / --quantization: one line
    if args.gpu_memory is not None:
        b = gpu_kv_budget(cfg, parse_bytes(args.gpu_memory), args.gpu_memory_utilization, args.dtype, args.num_params,
                          args.quantization)
        setup.kv_cache_memory = b["kv_bytes"]
        text = (f"{format_gib(b['kv_bytes'])} = {format_gib(b['gpu_memory'])} x {b['utilization']} - weights "
                f"{format_gib(b['weight_bytes'])} (~{b['params'] / 1e6:.0f}M params x {per_param:g} B"
                + (f", {args.quantization}" if args.quantization else "") + "); activations not subtracted")
        budget = {**b, "text": text}
    elif args.num_blocks is not None:
        setup.num_blocks = args.num_blocks
        budget = {"num_blocks": args.num_blocks, "text": f"{args.num_blocks} blocks (--num-blocks)"}
    else:
        memory = args.kv_cache_memory or "1GiB"
        setup.kv_cache_memory = parse_bytes(memory)
        budget = {"kv_bytes": setup.kv_cache_memory,
                  "text": f"{memory} (--kv-cache-memory" + ("" if args.kv_cache_memory else ", the default") + ")"}
    return setup, budget


@contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[str, int, int], None] | None]:
    """A transient progress bar on stderr per simulated run (finished requests of all); None when not a terminal."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("simulating {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, Any] = {}

        def report(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        yield report


def run_cli(args: Any) -> int:
    from pagedkv.sim.step_time_model import calibrate_from_trace
    from pagedkv.sim.workload import load_workload

    check_output_paths(args.trace and ("--trace", args.trace), args.plot and ("--plot", args.plot))
    setup, budget = setup_from_args(args)
    sweeps = [parse_sweep(s) for s in args.sweep]
    step_time = calibrate_from_trace(args.calibrate) if args.calibrate else default_step_time(setup)
    if args.step_time:
        step_time = step_time.with_overrides(args.step_time)
    workload = load_workload(
        args.workload, num_requests=args.num_requests, seed=args.seed, request_rate=args.request_rate
    )
    close_trace = None
    if args.trace:
        from pagedkv.plugins.telemetry import close as close_trace  # the final snapshot and an end line
    with progress_bar(enabled=sys.stderr.isatty()) as progress:
        report = simulate(workload, setup, step_time, compare_static=not args.no_static, sweeps=sweeps,
                          progress=progress, after_run=close_trace)
    report["budget"] = budget
    if args.plot:
        from pagedkv.sim.plot import plot_blocks

        report["plot"] = plot_blocks(args.plot, report)
    if args.trace:
        report["trace"] = args.trace
    if args.json:
        print(json.dumps(jsonable(report), indent=2))
    else:
        print(format_report(report))
        if args.trace:
            print(f"trace: {args.trace} (engine monitor --replay {args.trace})")
    return 0
