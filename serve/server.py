"""The uvicorn server ``engine serve`` runs: the app over an :class:`AsyncEngine`, the connection guards,
and a shutdown that drains the engine.

SIGINT/SIGTERM: stop accepting (new requests get 503), let in-flight requests run for
``shutdown_timeout`` seconds, then end whatever is left with finish reason ``abort``
(each stream still gets its last chunk and ``data: [DONE]``), and exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from pagedkv.serve.http.admission import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger("pagedkv.serve")


def make_server(engine: Any, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
                log_level: str = "warning", api_key: str | None = None, max_waiting: int = 256,
                shutdown_timeout: float = 10.0, tokenizer: Any = None,
                max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, header_timeout: float = 5.0,
                send_timeout: float | None = 60.0, body_timeout: float = 30.0, timeout_keep_alive: float = 5.0,
                limit_concurrency: int | None = 1024,
                enable_docs: bool = False, served_model_names: list[str] | None = None,
                sampling_defaults: dict[str, Any] | None = None, max_logprobs: int = 20,
                metrics_prefix: str = "pagedkv", tool_call_parser: str | None = None,
                enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None,
                allow_additional_properties: bool = False, trust_request_chat_template: bool = False,
                stream_stall_timeout: float | None = 15.0,
                max_prompt_logprobs_tokens: int | None = None, max_inflight_body_bytes: int | None = None,
                between_steps: Any = None) -> Any:
    """A uvicorn server for ``engine`` (not started: ``.run()``, or ``.run(sockets=[...])`` in a thread);
    ``between_steps``: called on the engine thread before each step (``engine serve --adapt-threads``)."""
    import uvicorn

    from pagedkv.serve.async_engine import AsyncEngine
    from pagedkv.serve.http.connection_guard import guarded_protocol
    from pagedkv.serve.http.metrics import ServerMetrics
    from pagedkv.serve.openai_app import ServerState, build_app

    if api_key is not None and not api_key.strip():
        raise ValueError("an empty API key would turn authentication off")
    metrics = ServerMetrics(model_name, prefix=metrics_prefix)
    async_engine = AsyncEngine(engine, max_waiting=max_waiting, on_step=metrics.update_from_engine,
                               stall_timeout=stream_stall_timeout, between_steps=between_steps)
    state = ServerState(async_engine, metrics, model_name, api_key=api_key, tokenizer=tokenizer,
                        max_request_bytes=max_request_bytes, body_timeout_s=body_timeout, enable_docs=enable_docs,
                        served_model_names=served_model_names, sampling_defaults=sampling_defaults,
                        max_logprobs=max_logprobs, tool_call_parser=tool_call_parser,
                        enable_auto_tool_choice=enable_auto_tool_choice, reasoning_parser=reasoning_parser,
                        allow_additional_properties=allow_additional_properties,
                        trust_request_chat_template=trust_request_chat_template,
                        max_prompt_logprobs_tokens=max_prompt_logprobs_tokens,
                        max_inflight_body_bytes=max_inflight_body_bytes)
    app = build_app(state)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None,
                            access_log=log_level == "debug", http=guarded_protocol(header_timeout, send_timeout),
                            timeout_keep_alive=timeout_keep_alive, limit_concurrency=limit_concurrency)
    return _GracefulServer(config, async_engine, shutdown_timeout)


def _server_class() -> type:
    import uvicorn

    logging.getLogger("uvicorn.error").addFilter(_drop_cancelled_requests)

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, with a shutdown that drains the engine instead of re-raising the signal."""

        def __init__(self, config: Any, async_engine: Any, shutdown_timeout: float) -> None:
            super().__init__(config)
            self.async_engine = async_engine
            self.shutdown_timeout = shutdown_timeout
            self._timer: threading.Timer | None = None
            self._force: threading.Timer | None = None

        async def startup(self, sockets: Any = None) -> None:
            from pagedkv.core.startup_phases import phase
            from pagedkv.serve.http.accept_guard import guard_accept, quiet_accept_errors

            loop = asyncio.get_running_loop()
            quiet_accept_errors(loop)  # for loops the guard cannot wrap
            shed = getattr(self.config.http, "shed_waiting", None)
            if shed is not None:
                guard_accept(loop, shed)
            with phase("server listening"):
                await super().startup(sockets=sockets)

        def handle_exit(self, sig: int, frame: Any) -> None:
            # uvicorn re-raises a captured signal after shutting down (a traceback for SIGINT,
            # exit code -15 for SIGTERM); a server stopped by a signal is a clean stop here.
            if self.should_exit:  # a second signal: end every request now, answered ('abort'), then go
                self.async_engine.abort_all()
                if self._force is None:
                    self._force = threading.Timer(_FORCE_AFTER_S, self._force_exit)
                    self._force.daemon = True
                    self._force.start()
                return
            self.begin_shutdown()

        def _force_exit(self) -> None:
            self.force_exit = True

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


_FORCE_AFTER_S = 2.0  # after a second signal: time for aborted requests to send their last bytes


def _drop_cancelled_requests(record: logging.LogRecord) -> bool:
    """A request task cancelled by a forced exit is not an error worth a traceback."""
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, asyncio.CancelledError)


def _GracefulServer(config: Any, async_engine: Any, shutdown_timeout: float) -> Any:  # noqa: N802 - a factory
    return _server_class()(config, async_engine, shutdown_timeout)
