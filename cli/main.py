"""The `engine` command: `engine run` (default model, demo workload) and friends.

It sits above core, plugins and monitor: the one place that composes them all."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pagedkv.core.errors import PagedKVError
from pagedkv.core.stats import summarize


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="pagedkv: a PagedAttention inference engine")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run a workload (the built-in chat demo by default) and print a summary")
    run.add_argument("--model", default=None, help="local HF model dir or .gguf (default: SmolLM2-135M-Instruct)")
    run.add_argument("--backend", default="torch", help="attention backend: torch, triton, cupy, ...")
    run.add_argument("--allocator", default="paged", help="block allocator: paged, or static (baseline)")
    run.add_argument("--block-size", type=int, default=16)
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", default=None, help="KV budget in bytes (e.g. 512MiB)")
    budget.add_argument("--num-blocks", type=int, default=None, help="KV budget in blocks")
    budget.add_argument("--gpu-memory-utilization", type=float, default=None, help="CUDA only, e.g. 0.9")
    run.add_argument("--max-model-len", type=int, default=None)
    run.add_argument("--max-num-seqs", type=int, default=128)
    run.add_argument("--max-num-batched-tokens", type=int, default=2048)
    run.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 (CUDA)")
    run.add_argument("--device", default="auto", help="cpu, cuda or auto")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="shard the model over N processes")
    run.add_argument("--threads", type=int, default=None,
                     help="torch CPU threads (default: torch's choice; 1 is faster on a busy shared machine)")
    run.add_argument("--prompt", action="append", default=None, help="a chat prompt (repeatable); default: demo")
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--top-k", type=int, default=0)
    run.add_argument("--ignore-eos", action="store_true")
    run.add_argument("--n", type=int, default=1, help="samples per prompt (parallel sampling)")
    run.add_argument("--enable-prefix-caching", action="store_true", help="reuse KV blocks of shared prefixes")
    run.add_argument("--enable-copy-on-write", action="store_true", help="n > 1 samples share prompt blocks")
    run.add_argument("--swap-space", default=None, help="CPU swap space for preempted requests, e.g. 4GiB")
    run.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    run.add_argument("--telemetry", default=None, metavar="ADDR",
                     help="stream block/request telemetry to unix:PATH or tcp:127.0.0.1:PORT (loopback only)")
    run.add_argument("--trace", default=None, metavar="FILE", help="record the telemetry stream to FILE (NDJSON)")
    run.add_argument("--monitor", action="store_true", help="watch the run in the live block-map dashboard")
    monitor = sub.add_parser("monitor", help="the live block-map dashboard: --connect ADDR or --replay FILE")
    from pagedkv.monitor.main import add_arguments as add_monitor_arguments

    add_monitor_arguments(monitor)
    plugins = sub.add_parser("plugins", help="list loaded plugins: distribution, version, hooks they implement")
    plugins.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    simulate = sub.add_parser("simulate", help="capacity planning: a workload through the real scheduler, no model")
    from pagedkv.cli.simulate import add_arguments as add_simulate_arguments

    add_simulate_arguments(simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run", *(argv or [])])
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "simulate":
            return cmd_simulate(args)
        if args.command == "monitor":
            from pagedkv.monitor.main import run as run_monitor

            return run_monitor(args)
    except PagedKVError as exc:
        print(f"engine: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # every rank of a tensor-parallel engine is stopped at exit
        print("engine: interrupted", file=sys.stderr)
        return 130
    parser.print_help()
    return 1


def cmd_run(args: argparse.Namespace) -> int:
    from pagedkv.core.config import EngineConfig
    from pagedkv.core.demo import DEMO_PROMPTS
    from pagedkv.core.engine import Engine
    from pagedkv.core.llm import apply_chat_template
    from pagedkv.core.sampling_params import SamplingParams

    if getattr(args, "monitor", False):
        from pagedkv.monitor.main import run_with_monitor

        return run_with_monitor(args, cmd_run)
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    config = EngineConfig(
        model=args.model,
        backend=args.backend,
        allocator=args.allocator,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_copy_on_write=args.enable_copy_on_write,
        swap_space=args.swap_space,
        telemetry=getattr(args, "telemetry", None),
        trace=getattr(args, "trace", None),
    )
    engine = Engine(config)
    if not args.json:
        print(engine.capacity_line(), flush=True)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=args.ignore_eos,
        n=args.n,
    )
    prompts = args.prompt or DEMO_PROMPTS
    ids = {}
    for prompt in prompts:
        token_ids = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
        ids[engine.add_request(token_ids, params)] = prompt
    started = time.perf_counter()
    results = {}
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            results[out.request_id] = out
    engine.stats.elapsed = time.perf_counter() - started
    engine.close()
    if config.telemetry or config.trace:
        from pagedkv.plugins.telemetry import close as close_telemetry

        close_telemetry(engine)  # the final snapshot and an end line, before the summary
    summary = summarize(engine)
    completions = [
        {"prompt": ids[rid], "completion": results[rid].text, "finish_reason": results[rid].outputs[0].finish_reason}
        for rid in ids
    ]
    if args.json:
        print(json.dumps({"capacity": capacity(engine), "completions": completions, "summary": summary}, indent=2))
    else:
        print_report(completions, summary)
    return 0


def capacity(engine: Any) -> dict:
    return {
        "num_blocks": engine.num_blocks,
        "block_size": engine.config.block_size,
        "tokens": engine.capacity_tokens,
        "max_model_len": engine.max_model_len,
        "max_concurrency": engine.capacity_tokens / engine.max_model_len,
        "backend": engine.config.backend,
        "device": engine.config.device,
        "dtype": str(engine.config.dtype).replace("torch.", ""),
    }


def print_report(completions: list[dict], summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for item in completions:
        console.print(f"[bold cyan]>>> {item['prompt']}[/]")
        console.print(item["completion"], markup=False, highlight=False)
        console.print()
    table = Table(title="pagedkv run summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value}")
    console.print(table)

def cmd_plugins(args: argparse.Namespace) -> int:
    """Every plugin in the ``pagedkv`` entry-point group, as PAGEDKV_PLUGINS / PAGEDKV_DISABLE_PLUGINS leave it."""
    from pagedkv.core.plugin_manager import list_plugins

    rows = list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        origin = f"{row['distribution'] or '?'} {row['version'] or ''}".strip()
        kind = "built-in" if row["builtin"] else "third-party"
        print(f"{row['name']:<16} {origin:<22} {kind:<12} {row['status']:<13} {', '.join(row['hooks']) or '-'}")
        if row["error"]:
            print(f"{'':<16} error: {row['error']}")
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pagedkv.cli.simulate import run_cli

    return run_cli(args)


if __name__ == "__main__":
    sys.exit(main())
