"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions, /v1/responses (``responses_api``) and /v1/models,
plus /health and /metrics.

The API key is checked before the body is read; the body is then read, parsed and
tokenized with bounded work off the event loop (``admission``); the engine thread only
sees token ids. Every answer that is not a success is OpenAI's error envelope, never a
traceback.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedkv.core.errors import RequestRejected
from pagedkv.serve.answer_json import encode_json
from pagedkv.serve.api.answer_limits import check_prompt_logprobs
from pagedkv.serve.api.chat import ChatCompletionRequest
from pagedkv.serve.api.completion import ServedCompletionRequest
from pagedkv.serve.api.errors import InvalidField, error_body, validation_error_body
from pagedkv.serve.api.generation import GenerationRequest
from pagedkv.serve.async_engine import AsyncEngine, QueueFull, ShuttingDown
from pagedkv.serve.heap import PeriodicTrim, freeze_startup_heap
from pagedkv.serve.http.admission import (
    DEFAULT_MAX_REQUEST_BYTES,
    check_chars,
    check_ids,
    encode_chat_request,
    encode_prompts,
    max_prompt_chars,
    validated_body,
)
from pagedkv.serve.http.body_budget import BodyBudget
from pagedkv.serve.http.metrics import ServerMetrics
from pagedkv.serve.http.template_sandbox import TemplateSandbox
from pagedkv.serve.logprobs_format import TokenTexts
from pagedkv.serve.responses import Job, collect, stream_events
from pagedkv.serve.responses_api import add_responses_route
from pagedkv.serve.structured_request import Parsers, compile_check
from pagedkv.serve.tokenizer_routes import add_tokenizer_routes, decode_ids

log = logging.getLogger("pagedkv.serve")

DEFAULT_BODY_TIMEOUT_S = 30.0


@dataclass
class ServerState:
    """What the routes need: the async engine, its metrics, names and limits, the front end's tokenizer."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    api_key: str | None = None
    retry_after_s: int = 1
    tokenizer: Any = None
    created: int = 0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    enable_docs: bool = False
    served_model_names: list[str] | None = None
    sampling_defaults: dict[str, Any] | None = None
    max_logprobs: int = 20
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    allow_additional_properties: bool = False  # JSON schemas as given, not closed to unlisted keys
    trust_request_chat_template: bool = False  # render requests' own chat templates (in a sandbox), as vLLM's flag
    max_prompt_logprobs_tokens: int | None = None  # prompt tokens per request with prompt_logprobs (None: context)
    max_inflight_body_bytes: int | None = None  # request bodies read or parsed at once (None: 4 bodies' worth)

    def __post_init__(self) -> None:
        core = self.engine.engine
        if self.tokenizer is None and core.tokenizer is not None:
            try:
                self.tokenizer = copy.deepcopy(core.tokenizer)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared (slow tokenizers are pure Python)
                self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.vocab_size = core.vocab_size
        self.created = self.created or int(time.time())
        self.token_texts = TokenTexts(self.tokenizer)
        self.served_model_names = list(self.served_model_names or [self.model_name])
        self.model_name = self.served_model_names[0]
        self.uses_priority = bool(getattr(core.scheduler, "uses_priority", False))
        self.max_prompt_chars = max_prompt_chars(self.max_model_len, self.tokenizer)
        # one thread owns the tokenizer; parsing and validation (pure functions) get a few of their own
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-tokenize")
        self.parse_pool = ThreadPoolExecutor(2, thread_name_prefix="pagedkv-parse")
        self.answer_pool = ThreadPoolExecutor(2, thread_name_prefix="pagedkv-answer")  # big answers, off the loop
        self.max_prompt_logprobs_tokens = self.max_prompt_logprobs_tokens or self.max_model_len
        self.body_budget = BodyBudget(self.max_inflight_body_bytes or 4 * self.max_request_bytes)
        self.bodies_read = 0  # request bodies read: with the engine's steps, the memory trimmer's activity
        self.trimmer = PeriodicTrim(lambda: self.engine.steps + self.bodies_read)
        self.parsers = Parsers(core.pm, self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser,
                              self.tokenizer)
        self.templates = None  # requests' chat templates: refused unless trusted, then sandboxed
        if self.trust_request_chat_template:
            special = getattr(self.tokenizer, "special_tokens_map", None) or {}
            self.templates = TemplateSandbox(special, self.max_prompt_chars)

    def close(self) -> None:
        self.trimmer.stop()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self.parse_pool.shutdown(wait=False, cancel_futures=True)
        self.answer_pool.shutdown(wait=False, cancel_futures=True)


def build_app(state: ServerState) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it when the server shuts down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        freeze_startup_heap()  # the model and the imports are loaded: collections need not walk them again
        state.engine.start()
        state.trimmer.start()
        try:
            yield
        finally:
            state.engine.stop()
            if state.templates is not None:
                await state.templates.aclose()
            state.close()

    app = FastAPI(title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pagedkv = state

    app.add_exception_handler(InvalidField, _refused)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)

    @app.get("/health")
    async def health() -> Response:
        if state.engine.dead is not None:
            return JSONResponse(error_body("the engine loop died", "internal_server_error"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise InvalidField(None, "a valid API key is required (Authorization: Bearer KEY)", 401,
                               "authentication_error")

    # no route takes a body parameter, so FastAPI reads no body: check_key runs before a byte of it is read
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "pagedkv",
                "root": name, "parent": None, "max_model_len": state.max_model_len}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card(name) for name in state.served_model_names]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in state.served_model_names:
            raise InvalidField("model", f"the model {model_id!r} does not exist; this server has "
                               f"{state.served_model_names}", 404, "not_found_error")
        return card(model_id)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await _guarded(_completions(state, request))

    @v1.post("/chat/completions")
    async def chat(request: Request) -> Response:
        return await _guarded(_chat(state, request))

    add_responses_route(v1, state, _answer, _guarded)
    app.include_router(v1)
    add_tokenizer_routes(app, state, check_key)
    if state.enable_docs:
        _add_docs(app, check_key)
    return app


async def _refused(request: Request, exc: InvalidField) -> JSONResponse:
    """The one handler of a bad field: OpenAI's error envelope, with the error's status."""
    # a body refused unread (413) or unfinished (408): close rather than drain what the client still sends
    headers = {"Connection": "close"} if exc.status in (408, 413) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kinds = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return JSONResponse(error_body(message, kinds.get(exc.status_code, "invalid_request_error"),
                                   code=exc.status_code), status_code=exc.status_code, headers=exc.headers)


def _add_docs(app: FastAPI, check_key: Any) -> None:
    """/docs and /openapi.json, behind the API key like /v1 (off unless --enable-docs)."""
    from fastapi.openapi.docs import get_swagger_ui_html

    docs = APIRouter(dependencies=[Depends(check_key)], include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @docs.get("/docs")
    async def swagger() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pagedkv")

    app.include_router(docs)


async def _guarded(work: Any) -> Response:
    """A route's work; a bug in it is one log line and a 500 in the envelope, never a traceback to the client."""
    try:
        return await work
    except InvalidField:
        raise  # the app's one handler answers it in OpenAI's envelope
    except Exception as exc:  # noqa: BLE001 - the last line of defence for one request
        log.error("request failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "internal_server_error", code=500),
                            status_code=500)


async def _completions(state: ServerState, request: Request) -> Response:
    body = await validated_body(state, request, ServedCompletionRequest)
    prompts = body.prompts()
    texts = [p for p in prompts if isinstance(p, str)]
    if texts:
        check_chars("prompt", max(map(len, texts)), state)
        if state.tokenizer is None:
            raise InvalidField("prompt", "this model has no tokenizer: give the prompt as token ids")
    for ids in prompts:
        if not isinstance(ids, str):
            check_ids(state, ids)
    loop = asyncio.get_running_loop()
    encoded = await loop.run_in_executor(state.tokenize_pool, encode_prompts, state.tokenizer, prompts,
                                         state.max_model_len, body.add_special_tokens)
    echo = None
    if body.echo:
        echo = await loop.run_in_executor(state.tokenize_pool, _echo_texts, state, prompts)
    return await _answer(state, request, body, encoded, "prompt", echo=echo, structured=body.constraint(
        allow_additional_properties=state.allow_additional_properties))


async def _chat(state: ServerState, request: Request) -> Response:
    body = await validated_body(state, request, ChatCompletionRequest)
    tools, choice = body.tool_setup()
    state.parsers.check_choice(choice)
    structured = body.constraint(choice, tools, state.allow_additional_properties)
    conversation = body.conversation()
    check_chars("messages", sum(len(m["content"]) for m in conversation), state)
    arguments = {**body.template_arguments(), "tools": tools or None}
    ids = await encode_chat_request(state, body, conversation, arguments, body.add_special_tokens)
    echo = [body.echo_text()] if body.echo else None
    return await _answer(state, request, body, [ids], "messages", echo=echo, structured=structured,
                         shaper=state.parsers.shaper(choice, tools))


def _echo_texts(state: ServerState, prompts: list[str | list[int]]) -> list[str]:
    """Completions' ``echo``: each prompt's text (token-id prompts decoded)."""
    return [p if isinstance(p, str) else decode_ids(state, p) for p in prompts]


async def _answer(state: ServerState, request: Request, body: GenerationRequest, prompts: list[list[int]],
                  prompt_field: str, echo: list[str] | None = None, structured: Any = (None, None),
                  shaper: Any = None) -> Response:
    if body.model not in (None, "", *state.served_model_names):
        raise InvalidField("model", f"the model {body.model!r} does not exist; this server has "
                           f"{state.model_name!r}", 404, "not_found_error")
    body.check_limits(state.max_logprobs, state.uses_priority)
    prompts = body.truncated(prompts, state.max_model_len)
    limit = state.max_model_len
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise InvalidField(prompt_field, f"the prompt has {longest} tokens; this model's context is {limit} "
                           "tokens, which leaves no room for an answer")
    max_tokens = body.max_tokens_for(longest, limit, (state.sampling_defaults or {}).get("max_tokens"))
    constraint, field = structured
    shaper, constraint = state.parsers.after_reasoning(shaper, constraint, prompts[0])
    params = body.to_sampling_params(max_tokens, state.vocab_size, state.sampling_defaults, constraint)
    check_prompt_logprobs(body, params, prompts, state.max_prompt_logprobs_tokens)
    sequences = len(prompts) * params.n
    if sequences > state.engine.max_waiting:
        raise InvalidField("n", f"this request needs {sequences} sequences (n x prompts), more than this server's "
                           f"waiting queue holds ({state.engine.max_waiting}, --max-waiting)")
    options = body.engine_options()
    if not state.engine.has_room(sequences, options.get("priority", 0)):
        return _queue_full(state, f"the waiting queue is full ({state.engine.max_waiting} sequences); retry later")
    await compile_check(state.engine.engine, constraint, field, request.client.host if request.client else "")
    response_id = f"{'chatcmpl' if body.chat else 'cmpl'}-{body.request_id or uuid.uuid4().hex}"
    job = Job(body.chat, response_id, state.model_name, body.n, [], sum(map(len, prompts)),
              max((len(s) for s in params.stop), default=1) - 1, state.metrics, params.logprobs, state.token_texts,
              echo=echo, prompt_ids=prompts if body.return_token_ids else None,
              shaper=shaper, continuous_usage=body.continuous_usage, echo_only=getattr(body, "echo_only", False))
    engine_prefix = f"{response_id}-{uuid.uuid4().hex[:8]}" if body.request_id else response_id
    try:
        for index, ids in enumerate(prompts):
            job.handles.append(await state.engine.add(ids, params, f"{engine_prefix}-{index}", **options))
    except QueueFull as exc:
        job.close()
        return _queue_full(state, str(exc))
    except ShuttingDown as exc:
        job.close()
        return JSONResponse(error_body(str(exc), "service_unavailable", code=503), status_code=503)
    except RequestRejected as exc:
        job.close()
        raise InvalidField(prompt_field, str(exc)) from exc
    except BaseException:
        job.close()
        raise
    if body.stream:
        return StreamingResponse(stream_events(job, body.include_usage), media_type="text/event-stream")
    try:
        status, payload = await _unless_disconnected(request, collect(job, state.answer_pool))
    finally:
        job.close()
    if status is None:
        return Response(status_code=499)
    if status == 503:  # evicted from the full queue by a better-priority request: a full queue's answer
        return _queue_full(state, payload["error"]["message"])
    content = await asyncio.get_running_loop().run_in_executor(state.answer_pool, encode_json, payload)
    return EncodedJSONResponse(content, status_code=status)


class EncodedJSONResponse(JSONResponse):
    """A JSONResponse whose body was encoded already (off the event loop, by ``encode_json``)."""

    def render(self, content: Any) -> bytes:
        return content


def _queue_full(state: ServerState, message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "service_unavailable", code=503), status_code=503,
                        headers={"Retry-After": str(state.retry_after_s)})


async def _unless_disconnected(request: Request, work: Any) -> tuple[Any, Any]:
    """Run ``work``; if the client disconnects first, cancel it (its requests abort) and return (None, None)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        return None, None
    return task.result()
