"""``engine serve``: load the model, start the engine thread, serve the OpenAI API with uvicorn.

SIGINT/SIGTERM: stop accepting (new requests get 503), let in-flight requests run for
``--shutdown-timeout`` seconds, then end whatever is left with finish reason ``abort``
(each stream still gets its last chunk and ``data: [DONE]``), and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

log = logging.getLogger("pagedkv.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default=None,
      help="local HF model dir, .gguf, or cached hub id org/name (default: SmolLM2-135M-Instruct)")
    a("--revision", default=None, help="branch, tag or commit of a cached hub model")
    a("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    a("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    a("--port", type=int, default=8000)
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes (or PAGEDKV_API_KEY)")
    a("--max-waiting", type=int, default=256, help="waiting sequences before new requests get 503 + Retry-After")
    a("--shutdown-timeout", type=float, default=10.0,
      help="seconds in-flight requests may go on after SIGINT/SIGTERM before they end with finish reason 'abort'")
    a("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    a("--backend", default="auto", help="attention backend: auto (cpu on CPU, else torch), cpu, torch, triton, cupy")
    a("--tensor-parallel-size", "-tp", type=int, default=1, help="shard the model over N processes")
    a("--allocator", default="paged", help="block allocator: paged, or static (baseline)")
    a("--block-size", type=int, default=16)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--kv-cache-memory", default=None, help="KV budget in bytes (e.g. 512MiB)")
    budget.add_argument("--num-blocks", type=int, default=None, help="KV budget in blocks")
    budget.add_argument("--gpu-memory-utilization", type=float, default=None, help="CUDA only, e.g. 0.9")
    a("--max-model-len", type=int, default=None)
    a("--max-num-seqs", type=int, default=128)
    a("--max-num-batched-tokens", type=int, default=2048)
    a("--dtype", default="float32", help="float32, bfloat16, float16 (CUDA)")
    a("--kv-cache-dtype", default="auto",
      help="KV storage: auto (the model dtype), bfloat16, float16, int8, fp8_e4m3, fp8_e5m2")
    a("--device", default="auto", help="cpu, cuda or auto")
    a("--seed", type=int, default=0)
    a("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
      help="reuse KV blocks of shared prefixes (on by default, as in vLLM: chats share their system prompt)")
    a("--enable-copy-on-write", action="store_true", help="n > 1 samples share prompt blocks")
    a("--swap-space", default=None, help="CPU swap space for preempted requests, e.g. 4GiB")
    a("--telemetry", default=None, metavar="ADDR",
      help="stream block/request telemetry to unix:PATH or tcp:127.0.0.1:PORT (engine monitor --connect ADDR)")
    a("--trace", default=None, metavar="FILE", help="record the telemetry stream to FILE (NDJSON)")


def run(args: argparse.Namespace) -> int:
    """Serve until a signal; 0 on a clean shutdown."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"engine serve needs the serve extra: pip install 'pagedkv[serve]' ({exc})", file=sys.stderr)
        return 2
    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine
    from pagedkv.core.model.model_loader import DEFAULT_MODEL

    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    config = EngineConfig(
        model=args.model, revision=args.revision, backend=args.backend,
        tensor_parallel_size=args.tensor_parallel_size, allocator=args.allocator, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype, device=args.device, seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_copy_on_write=args.enable_copy_on_write, swap_space=args.swap_space, telemetry=args.telemetry,
        trace=args.trace,
    )
    engine = Engine(config)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else DEFAULT_MODEL)
    print(engine.capacity_line(), file=sys.stderr, flush=True)
    server = make_server(engine, name, host=args.host, port=args.port, log_level=args.log_level,
                         api_key=args.api_key or os.environ.get("PAGEDKV_API_KEY") or None,
                         max_waiting=args.max_waiting, shutdown_timeout=args.shutdown_timeout)
    print(f"engine serve: {name} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        if config.telemetry or config.trace:
            from pagedkv.plugins.telemetry import close as close_telemetry

            close_telemetry(engine)
        engine.close()  # tensor-parallel workers, if any
    return 0


def make_server(engine: Any, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "warning", api_key: str | None = None, max_waiting: int = 256,
                shutdown_timeout: float = 10.0, tokenizer: Any = None) -> Any:
    """A uvicorn server for ``engine`` (not started: ``.run()``, or ``.run(sockets=[...])`` in a thread)."""
    import uvicorn

    from pagedkv.serve.async_engine import AsyncEngine
    from pagedkv.serve.metrics import ServerMetrics
    from pagedkv.serve.openai_app import ServerState, build_app

    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, on_step=metrics.update_from_engine)
    state = ServerState(async_engine, metrics, model_name, api_key=api_key, tokenizer=tokenizer)
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None,
                            access_log=log_level == "debug")
    return _GracefulServer(config, async_engine, shutdown_timeout)


def _server_class() -> type:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, with a shutdown that drains the engine instead of re-raising the signal."""

        def __init__(self, config: Any, async_engine: Any, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.async_engine = async_engine
            self.shutdown_timeout = shutdown_timeout
            self._timer: threading.Timer | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises a captured signal after shutting down (a traceback for SIGINT,
            # exit code -15 for SIGTERM); a server stopped by a signal is a clean stop here.
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
                self.async_engine.abort_all()
                return
            self.begin_shutdown()

        def begin_shutdown(self) -> None:
            """Stop accepting; in-flight requests go on for ``shutdown_timeout`` s, then end with 'abort'."""
            if self.should_exit:
                return
            log.info("shutting down: no new requests; in-flight ones have %.0f s", self.shutdown_timeout)
            self.async_engine.drain()
            self._timer = threading.Timer(self.shutdown_timeout, self.async_engine.abort_all)
            self._timer.daemon = True
            self._timer.start()
            self.should_exit = True

    return GracefulServer


def _GracefulServer(config: Any, async_engine: Any, shutdown_timeout: float) -> Any:  # noqa: N802 - a factory
    return _server_class()(config, async_engine, shutdown_timeout)
