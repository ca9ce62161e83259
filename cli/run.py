"""``engine run``: the arguments, a workload (the built-in chat demo by default, or a batch file) through
the engine, and the summary."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pagedkv.cli.demo import DEMO_PROMPTS
from pagedkv.cli.engine_args import add_engine_arguments, engine_config
from pagedkv.cli.interrupts import StopBetweenSteps, exit_status
from pagedkv.cli.prompt_format import encode_run_prompt, use_chat
from pagedkv.cli.run_checks import check_run_args
from pagedkv.cli.run_display import drive
from pagedkv.core.errors import PagedKVError
from pagedkv.core.stats import summarize

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_arguments(run: argparse.ArgumentParser) -> None:
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


def cmd_run(args: argparse.Namespace) -> int:
    """``engine run``: the exit status (128 + the signal's number when a signal stopped the run)."""
    from pagedkv.core.startup_phases import phase

    with phase("torch and the engine imported"):
        from pagedkv.core.engine import Engine
        from pagedkv.core.sample.sampling_params import SamplingParams  # noqa: F401 - timed here, used below

    if getattr(args, "monitor", False):
        from pagedkv.monitor.launch import run_with_monitor

        return run_with_monitor(args, cmd_run)
    config, params = checked_setup(args)  # before the model loads: a bad value costs nothing
    if not args.json:  # the arguments are fine: say what the wait is for
        what = args.model or DEFAULT_MODEL_NAME
        print(f"engine: loading {what} ({config.backend} backend, {config.device})...", flush=True)  # (stderr: errors)
    engine = Engine(config)
    if not args.json:
        print(engine.capacity_line(), flush=True)
    if args.input is not None:
        return run_batch_files(engine, args)
    ids = submit_prompts(engine, args, params)
    streaming = len(ids) == 1 and args.n == 1 and not args.json
    results, stop = generate(engine, ids, streaming)
    summary = finish(engine, config)
    if stop.signum is not None:
        summary.update(stopped_by=stop.name, unfinished_requests=len(ids) - len(results))
    completions = completion_records(args, ids, results)
    if args.json:
        print(json.dumps({"capacity": capacity(engine), "completions": completions, "summary": summary}, indent=2))
    else:
        print_report([] if streaming else completions, summary)
    return 0 if stop.signum is None else exit_status(stop.signum)


def checked_setup(args: argparse.Namespace) -> tuple[Any, Any]:
    """The engine config and the sampling parameters, every flag checked (and ``--threads`` applied)."""
    from pagedkv.core.sample.sampling_params import SamplingParams

    check_run_args(args)
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    if (args.input is None) != (args.output is None):
        raise PagedKVError("--input and --output go together (a batch file in, a results file out)")
    if args.input is not None:
        from pagedkv.cli.batch_output import check_batch_paths

        check_batch_paths(args.input, args.output)
    config = engine_config(args)
    params = SamplingParams(
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
    return config, params


def submit_prompts(engine: Any, args: argparse.Namespace, params: Any) -> dict[str, str]:
    """Add every ``--prompt`` (the demo's by default) to the engine: request id -> prompt."""
    ids = {}
    chat = use_chat(engine.tokenizer, args.chat)
    for prompt in args.prompt or DEMO_PROMPTS:
        ids[engine.add_request(encode_run_prompt(engine.tokenizer, prompt, chat), params)] = prompt
    return ids


def generate(engine: Any, ids: dict[str, str], streaming: bool) -> tuple[dict[str, Any], StopBetweenSteps]:
    """Step the engine until every request finishes or a signal stops it; the outputs and the stop."""
    started = time.perf_counter()
    if streaming:
        from rich.console import Console

        Console().print(f"[bold cyan]>>> {next(iter(ids.values()))}[/]")
    with StopBetweenSteps() as stop:  # Ctrl-C / SIGTERM: finish this step, then report what finished
        results = drive(engine, list(ids), sys.stdout if streaming else None,
                        progress=not streaming and _tty(sys.stderr), stop=lambda: stop.signum is not None)
    engine.stats.elapsed = time.perf_counter() - started
    return results, stop


def finish(engine: Any, config: Any) -> dict:
    """Close the engine (and the telemetry's files: their final snapshot and end line); the run's summary."""
    engine.close()
    if config.telemetry or config.trace:
        from pagedkv.plugins.telemetry import close as close_telemetry

        close_telemetry(engine)  # the final snapshot and an end line, before the summary
    return summarize(engine)


def completion_records(args: argparse.Namespace, ids: dict[str, str], results: dict[str, Any]) -> list[dict]:
    """One record per finished prompt: its completion, and every sample (``--n``) and logprob asked for."""
    finished = [rid for rid in ids if rid in results]
    completions = [
        {"prompt": ids[rid], "completion": results[rid].text, "finish_reason": results[rid].outputs[0].finish_reason}
        for rid in finished
    ]
    if args.n > 1:  # every sample, not only the first (the first stays in "completion")
        for item, rid in zip(completions, finished):
            item["samples"] = [{"index": c.index, "completion": c.text, "finish_reason": c.finish_reason}
                               for c in results[rid].outputs]
    if args.logprobs is not None:  # per generated token {token id: logprob}, the sampled token first
        for item, rid in zip(completions, finished):
            first = results[rid].outputs[0]
            item.update(cumulative_logprob=first.cumulative_logprob, logprobs=first.logprobs)
    return completions


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
        ok, bad = run_batch(engine, lines, sink.write, args.model or DEFAULT_MODEL_NAME, args.max_tokens)
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
        **weights(engine.model),
    }


def weights(model: Any) -> dict:
    """The resident weight bytes (quantized blocks as their bytes) and the block formats, for the report."""
    import torch

    if not isinstance(model, torch.nn.Module):
        return {}
    from pagedkv.core.model.quant_linear import weight_bytes, weight_formats

    return {"weight_bytes": weight_bytes(model), "weight_formats": weight_formats(model)}


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
