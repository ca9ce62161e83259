"""The `engine` command: `engine run` (default model, demo workload) and friends.

It sits above core, plugins and monitor: the one place that composes them all."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pagedkv.cli.interrupts import (
    SignalsAfterReturn,
    StopBetweenSteps,
    exit_status,
    raise_on_sigterm,
    report_interrupt,
)
from pagedkv.cli.run_display import drive
from pagedkv.core.errors import PagedKVError
from pagedkv.core.startup_phases import mark, since_start
from pagedkv.core.stats import summarize


def build_parser() -> argparse.ArgumentParser:
    from pagedkv import __version__

    parser = argparse.ArgumentParser(prog="engine", description="pagedkv: a PagedAttention inference engine")
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="how much pagedkv logs to stderr (default: %(default)s)")
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run a workload (the built-in chat demo by default) and print a summary",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from pagedkv.cli.engine_args import add_engine_arguments

    add_engine_arguments(run, prefix_caching=False)
    run.add_argument("--prompt", action="append", default=None, help="a chat prompt (repeatable); default: demo")
    run.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap prompts in the model's chat template (default: when the tokenizer has one)")
    run.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most per sample")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    run.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 = off")
    run.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    run.add_argument("--repetition-penalty", type=float, default=1.0, help="over prompt + output tokens; 1 = off")
    run.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, over output tokens")
    run.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, over output tokens")
    run.add_argument("--logprobs", type=int, default=None, metavar="K",
                     help="report each generated token's logprob and the top K (--json shows them)")
    run.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    run.add_argument("--n", type=int, default=1, help="samples per prompt (parallel sampling)")
    run.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    run.add_argument("--input", default=None, metavar="FILE",
                     help="a batch file in the OpenAI batch format (JSONL: custom_id, method, url, body)")
    run.add_argument("--output", default=None, metavar="FILE", help="where --input's results go (JSONL)")
    run.add_argument("--monitor", action="store_true", help="watch the run in the live block-map dashboard")
    monitor = sub.add_parser("monitor", help="the live block-map dashboard: --connect ADDR or --replay FILE",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from pagedkv.cli.monitor import add_arguments as add_monitor_arguments

    add_monitor_arguments(monitor)
    plugins = sub.add_parser("plugins", help="list loaded plugins: distribution, version, hooks they implement")
    plugins.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")
    simulate = sub.add_parser("simulate", help="capacity planning: a workload through the real scheduler, no model",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from pagedkv.cli.simulate import add_arguments as add_simulate_arguments

    add_simulate_arguments(simulate)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from pagedkv.cli.serve import add_arguments as add_serve_arguments

    add_serve_arguments(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    imported = since_start()  # the interpreter's start and `import pagedkv.cli.main`
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args([*(argv or []), "run"])
    import logging

    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(levelname)s: %(message)s")
    mark("python started, engine imported", imported)
    mark("arguments parsed", since_start() - imported)
    raise_on_sigterm()
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "plugins":
            return cmd_plugins(args)
        if args.command == "simulate":
            return cmd_simulate(args)
        if args.command == "serve":
            from pagedkv.cli.serve import run as run_serve

            return run_serve(args)
        if args.command == "monitor":
            from pagedkv.cli.monitor import run as run_monitor

            return run_monitor(args)
    except PagedKVError as exc:
        print(f"engine: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM outside a run loop (e.g. while the model loads)
        return report_interrupt(exc)
    parser.print_help()
    return 1


def cmd_run(args: argparse.Namespace) -> int:
    from pagedkv.core.startup_phases import phase

    with phase("torch and the engine imported"):
        from pagedkv.cli.demo import DEMO_PROMPTS
        from pagedkv.cli.engine_args import engine_config
        from pagedkv.cli.prompt_format import encode_run_prompt, use_chat
        from pagedkv.cli.run_checks import check_run_args
        from pagedkv.core.engine import Engine
        from pagedkv.core.sample.sampling_params import SamplingParams

    if getattr(args, "monitor", False):
        from pagedkv.monitor.launch import run_with_monitor

        return run_with_monitor(args, cmd_run)
    check_run_args(args)
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    if (args.input is None) != (args.output is None):
        raise PagedKVError("--input and --output go together (a batch file in, a results file out)")
    if args.input is not None:
        from pagedkv.cli.batch_output import check_batch_paths

        check_batch_paths(args.input, args.output)  # before the model loads
    config = engine_config(args)
    params = SamplingParams(  # before the model loads: a bad value costs nothing
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logprobs=args.logprobs,
        ignore_eos=args.ignore_eos,
        n=args.n,
    )
    if not args.json:  # the arguments are fine: say what the wait is for
        what = args.model or "SmolLM2-135M-Instruct"
        print(f"engine: loading {what} ({config.backend} backend, {config.device})...", flush=True)  # (stderr: errors)
    engine = Engine(config)
    if not args.json:
        print(engine.capacity_line(), flush=True)
    if args.input is not None:
        return run_batch_files(engine, args)
    prompts = args.prompt or DEMO_PROMPTS
    ids = {}
    chat = use_chat(engine.tokenizer, args.chat)
    for prompt in prompts:
        ids[engine.add_request(encode_run_prompt(engine.tokenizer, prompt, chat), params)] = prompt
    started = time.perf_counter()
    streaming = len(ids) == 1 and args.n == 1 and not args.json
    if streaming:
        from rich.console import Console

        Console().print(f"[bold cyan]>>> {prompts[0]}[/]")
    with StopBetweenSteps() as stop:  # Ctrl-C / SIGTERM: finish this step, then report what finished
        results = drive(engine, list(ids), sys.stdout if streaming else None,
                        progress=not streaming and _tty(sys.stderr), stop=lambda: stop.signum is not None)
    engine.stats.elapsed = time.perf_counter() - started
    engine.close()
    if config.telemetry or config.trace:
        from pagedkv.plugins.telemetry import close as close_telemetry

        close_telemetry(engine)  # the final snapshot and an end line, before the summary
    summary = summarize(engine)
    if stop.signum is not None:
        summary.update(stopped_by=stop.name, unfinished_requests=len(ids) - len(results))
    completions = [
        {"prompt": ids[rid], "completion": results[rid].text, "finish_reason": results[rid].outputs[0].finish_reason}
        for rid in ids if rid in results
    ]
    if args.n > 1:  # every sample, not only the first (the first stays in "completion")
        for item, rid in zip(completions, [rid for rid in ids if rid in results]):
            item["samples"] = [{"index": c.index, "completion": c.text, "finish_reason": c.finish_reason}
                               for c in results[rid].outputs]
    if args.logprobs is not None:  # per generated token {token id: logprob}, the sampled token first
        for item, rid in zip(completions, [rid for rid in ids if rid in results]):
            first = results[rid].outputs[0]
            item.update(cumulative_logprob=first.cumulative_logprob, logprobs=first.logprobs)
    if args.json:
        print(json.dumps({"capacity": capacity(engine), "completions": completions, "summary": summary}, indent=2))
    else:
        print_report([] if streaming else completions, summary)
    return 0 if stop.signum is None else exit_status(stop.signum)


def _tty(stream: Any) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def run_batch_files(engine: Any, args: argparse.Namespace) -> int:
    """``--input``/``--output``: every result is written (and flushed) as soon as its request finishes.

    The input is read as bytes, so a line that is not UTF-8 is that line's error, not the run's;
    the output file is opened at the first result (``cli/batch_output.py``).
    """
    from pagedkv.cli.batch_file import run_batch
    from pagedkv.cli.batch_output import LazyOutput, check_batch_paths

    check_batch_paths(args.input, args.output)
    try:
        with open(args.input, "rb") as source:
            lines = source.read().splitlines()
    except OSError as exc:
        raise PagedKVError(f"cannot read --input {args.input}: {exc.strerror}") from None
    started = time.perf_counter()
    sink = LazyOutput(args.output)
    try:
        ok, bad = run_batch(engine, lines, sink.write, args.model or "SmolLM2-135M-Instruct", args.max_tokens)
    finally:
        sink.close()
    engine.stats.elapsed = time.perf_counter() - started
    print(f"batch: {ok} succeeded, {bad} failed; results in {args.output}", file=sys.stderr)
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
        "kv_cache_dtype": engine.config.kv_cache_dtype,
    }


def print_report(completions: list[dict], summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for item in completions:
        console.print(f"[bold cyan]>>> {item['prompt']}[/]")
        if "samples" in item:
            for sample in item["samples"]:
                console.print(f"[dim]--- sample {sample['index'] + 1} of {len(item['samples'])} "
                              f"({sample['finish_reason']})[/]")
                console.print(sample["completion"], markup=False, highlight=False)
        else:
            console.print(item["completion"], markup=False, highlight=False)
        if item.get("cumulative_logprob") is not None:
            console.print(f"[dim]cumulative logprob {item['cumulative_logprob']:.3f}[/]")
        console.print()
    table = Table(title="pagedkv run summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value}")
    console.print(table)

def cmd_plugins(args: argparse.Namespace) -> int:
    """Every plugin in the ``pagedkv`` entry-point group, as PAGEDKV_PLUGINS / PAGEDKV_DISABLE_PLUGINS leave it."""
    from pagedkv.core.plugin.plugin_manager import list_plugins

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


def entry() -> None:
    """The ``engine`` console script: :func:`main`, then an exit without the interpreter's teardown.

    Tearing down torch's thousands of modules and C++ state took 1.5-1.9 s after ``engine run`` had
    printed everything (issue 26), time in which the shell waits for nothing. The exit handlers still
    run (logging, telemetry files, plugins', tensor-parallel workers'), and both streams are flushed;
    only the module teardown is skipped. An exception leaves through the normal path (its traceback).
    A SIGINT/SIGTERM that lands in main's own error report, or while the exit handlers run, ends the
    process with 128 + its number and no traceback.
    """
    import atexit
    import os

    try:
        code = main()
    except KeyboardInterrupt as exc:  # inside main's except clauses, after its run or error report
        code = report_interrupt(exc)
    late = SignalsAfterReturn().hold()
    atexit._run_exitfuncs()  # what a normal exit runs first, in the same order
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (engine run | head): nothing left to deliver
            pass
    if late.status is not None:
        code = late.status
    os._exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    entry()
