"""``engine serve``: the arguments, the model loaded from them, and the server (``serve/server.py``) run.

SIGINT/SIGTERM: stop accepting (new requests get 503), let in-flight requests run for
``--shutdown-timeout`` seconds, then end whatever is left with finish reason ``abort``
(each stream still gets its last chunk and ``data: [DONE]``), and exit 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pagedkv.serve.http.admission import DEFAULT_MAX_REQUEST_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pagedkv.cli.engine_args import add_engine_arguments

    a = parser.add_argument
    a("model_tag", nargs="?", default=None, metavar="MODEL",
      help="the model, as `vllm serve MODEL` takes it (same as --model)%(default).0s")
    a("--served-model-name", nargs="+", default=None, metavar="NAME",
      help="the model id(s) clients send; responses carry the first (default: the model argument as "
      "given, and its basename)%(default).0s")
    a("--host", default="127.0.0.1", help="bind address (default: %(default)s, this machine only)")
    a("--port", type=int, default=8000, help="(default: %(default)s)")
    a("--api-key", default=None,
      help="require 'Authorization: Bearer KEY' on /v1 routes (or PAGEDKV_API_KEY) (default: none)%(default).0s")
    a("--allow-insecure-host", action="store_true",
      help="allow a --host other than loopback without an API key (refused otherwise)")
    a("--enable-docs", action="store_true", help="serve /docs and /openapi.json (behind the API key; off by default)")
    a("--max-waiting", type=int, default=256,
      help="waiting sequences (each request counts its n) before new requests get 503 + Retry-After "
      "(default: %(default)s)")
    a("--max-request-bytes", default=str(DEFAULT_MAX_REQUEST_BYTES),
      help="largest request body, e.g. 4MiB; a larger one is refused with 413 while it is read (default: %(default)s)")
    a("--header-timeout", type=float, default=5.0,
      help="seconds a connection may take to send a request's headers before it is closed (slowloris) "
      "(default: %(default)s)")
    a("--body-timeout", type=float, default=30.0,
      help="seconds a request body may take to arrive (408 after) (default: %(default)s)")
    a("--send-timeout", type=float, default=60.0,
      help="seconds a client may accept no bytes of a response (it stopped reading) before the connection is "
      "aborted and its requests end, freeing their KV blocks; nginx's send_timeout; 0 turns it off "
      "(default: %(default)s)")
    a("--stream-stall-timeout", type=float, default=15.0,
      help="seconds a stream's reader may leave an output unread (it stopped reading) before its requests are "
      "aborted, freeing their KV blocks; unread outputs are replaced by newer ones meanwhile, never queued; "
      "0 turns it off (default: %(default)s)")
    a("--max-inflight-body-bytes", default=None,
      help="request bytes all bodies being read or parsed may hold together, e.g. 16MiB; a body that does not fit "
      "waits (within --body-timeout) (default: 4 x --max-request-bytes)%(default).0s")
    a("--timeout-keep-alive", type=float, default=5.0,
      help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    a("--limit-concurrency", type=int, default=1024,
      help="connections + in-flight requests before new requests get 503 (uvicorn's limit) (default: %(default)s)")
    a("--shutdown-timeout", type=float, default=10.0,
      help="seconds in-flight requests may go on after SIGINT/SIGTERM before they end with finish reason 'abort' "
      "(default: %(default)s)")
    a("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
      help="uvicorn's log level (default: %(default)s)")
    a("--generation-config", default="auto", metavar="auto|vllm|DIR",
      help="sampling defaults for fields a request leaves unset: auto (the model's generation_config.json), "
      "vllm (none: OpenAI's defaults), or a directory with a generation_config.json (default: %(default)s)")
    a("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
      help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's (default: the "
      "tokenizer's)%(default).0s")
    a("--trust-request-chat-template", action="store_true",
      help="render a chat_template sent in a request (a template is code), in a sandbox process with a time, "
      "length and memory limit; without it such a request is refused with 400, as vLLM does")
    a("--max-logprobs", type=int, default=20,
      help="the most logprobs / top_logprobs / prompt_logprobs a request may ask for, up to 20 (default: %(default)s)")
    a("--max-prompt-logprobs-tokens", type=int, default=None,
      help="prompt tokens, all of a request's prompts together, whose prompt_logprobs (or echoed logprobs) a "
      "request may ask for; more is a 400 (default: the model's context length)%(default).0s")
    a("--metrics-prefix", default="pagedkv", choices=["pagedkv", "vllm"],
      help="Prometheus metric prefix; vllm gives vLLM's names, so its dashboards work unchanged "
      "(default: %(default)s)")
    a("--enable-prompt-tokens-details", action="store_true",
      help="accepted for vLLM compatibility: usage.prompt_tokens_details.cached_tokens is always reported")
    a("--enable-auto-tool-choice", action="store_true",
      help="let the model call tools on its own (tool_choice auto); needs --tool-call-parser")
    a("--tool-call-parser", default=None,
      help="how tool calls are written in the model's text: hermes, llama3_json, pythonic, mistral (or a plugin's) "
      "(default: none)%(default).0s")
    a("--reasoning-parser", default=None,
      help="split the thinking into reasoning_content: deepseek_r1, qwen3 (or a plugin's) (default: none)%(default).0s")
    a("--structured-outputs-allow-additional-properties", action="store_true",
      help="compile JSON schemas as given: an object schema that leaves additionalProperties unset lets the model "
      "add unlisted keys (default: off: such keys are forbidden, as by vLLM's default grammar backend)")
    a("--adapt-threads", action=argparse.BooleanOptionalAction, default=False,
      help="on CPU, step with fewer threads while other processes keep cores busy, back up when they stop "
      "(each step's threads wait for each other: one descheduled thread stalls all); off by default: a client on "
      "the same machine counts as such a process (default: %(default)s)")
    add_engine_arguments(parser, prefix_caching=True)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal; 0 on a clean shutdown."""
    from pagedkv.core.startup_phases import phase

    try:
        with phase("fastapi and uvicorn imported"):
            import fastapi  # noqa: F401
            import prometheus_client  # noqa: F401
            import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"engine serve needs the serve extra: pip install 'pagedkv[serve]' ({exc})", file=sys.stderr)
        return 2
    from pagedkv.cli.engine_args import take_positional_model
    from pagedkv.serve.serve_checks import check_serve_args

    with phase("torch and the engine imported"):
        from pagedkv.core.engine import Engine  # noqa: F401 - timed here, used by _load_engine
    take_positional_model(args)
    api_key = check_serve_args(args)  # before the model loads: a bad flag costs a line, not a minute
    loaded = _load_engine(args)
    if loaded is None:
        return 2
    engine, defaults = loaded
    try:
        _serve(engine, args, api_key, defaults)
    finally:
        if engine.config.telemetry or engine.config.trace:
            from pagedkv.plugins.telemetry import close as close_telemetry

            close_telemetry(engine)
        engine.close()  # tensor-parallel workers, if any
    return 0


def _load_engine(args: argparse.Namespace) -> tuple[Any, dict[str, Any]] | None:
    """The engine the flags describe and the sampling defaults it serves with; None after a flag error."""
    from pagedkv.cli.engine_args import engine_config
    from pagedkv.core.engine import Engine
    from pagedkv.core.errors import ConfigError
    from pagedkv.core.sample.sampling_params import MAX_LOGPROBS
    from pagedkv.serve.generation_defaults import load_chat_template, sampling_defaults

    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ConfigError(f"--max-logprobs must be in 0..{MAX_LOGPROBS} (pagedkv's cap), got {args.max_logprobs}")
    template = load_chat_template(args.chat_template) if args.chat_template else None
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    config = engine_config(args)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("engine: error: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return None
    engine = Engine(config)
    if template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = template
    defaults = sampling_defaults(args.generation_config, engine.model)
    if defaults:
        print(f"engine serve: sampling defaults from the model's generation config: {defaults} "
              "(--generation-config vllm turns them off)", file=sys.stderr, flush=True)
    return engine, defaults


def default_served_names(model: str) -> list[str]:
    """Without --served-model-name: the model argument as given (vLLM's name, what clients started with it
    send), then its directory's basename, which pagedkv answered to alone before."""
    basename = os.path.basename(os.path.normpath(model))
    return [model] if basename in ("", model) else [model, basename]


def _thread_share(engine: Any, args: argparse.Namespace) -> Any:
    """``ThreadShare.tick`` for a one-process CPU engine with ``--adapt-threads``; None otherwise."""
    config = engine.config
    if not args.adapt_threads or not str(config.device).startswith("cpu") or config.tensor_parallel_size > 1:
        return None
    import torch

    from pagedkv.core.thread_share import ThreadShare

    share = ThreadShare(torch.get_num_threads(), torch.set_num_threads)
    return share.tick


def _serve(engine: Any, args: argparse.Namespace, api_key: str | None, defaults: dict[str, Any]) -> None:
    """Run the server for ``engine`` until a signal stops it."""
    from pagedkv.core.model.model_loader import DEFAULT_MODEL
    from pagedkv.serve.server import make_server

    names = args.served_model_name or default_served_names(args.model or DEFAULT_MODEL)
    name = names[0]
    print(engine.capacity_line(), file=sys.stderr, flush=True)
    server = make_server(engine, name, host=args.host, port=args.port, log_level=args.log_level, api_key=api_key,
                         max_waiting=args.max_waiting, shutdown_timeout=args.shutdown_timeout,
                         max_request_bytes=args.max_request_bytes, header_timeout=args.header_timeout,
                         send_timeout=args.send_timeout or None, body_timeout=args.body_timeout,
                         timeout_keep_alive=args.timeout_keep_alive,
                         limit_concurrency=args.limit_concurrency, enable_docs=args.enable_docs,
                         served_model_names=names, sampling_defaults=defaults, max_logprobs=args.max_logprobs,
                         metrics_prefix=args.metrics_prefix, tool_call_parser=args.tool_call_parser,
                         enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser,
                         allow_additional_properties=args.structured_outputs_allow_additional_properties,
                         trust_request_chat_template=args.trust_request_chat_template,
                         stream_stall_timeout=args.stream_stall_timeout or None,
                         max_prompt_logprobs_tokens=args.max_prompt_logprobs_tokens,
                         max_inflight_body_bytes=args.max_inflight_body_bytes,
                         between_steps=_thread_share(engine, args))
    print(f"engine serve: {name} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    server.run()
