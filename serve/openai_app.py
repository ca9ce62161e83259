"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health and /metrics.

Requests are checked and tokenized here, on the asyncio side, with the front end's own
copy of the tokenizer (a fast tokenizer must not be used from two threads at once);
the engine thread only sees token ids.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.core.errors import RequestRejected
from pagedkv.serve.async_engine import AsyncEngine, QueueFull, ShuttingDown
from pagedkv.serve.logprobs_format import TokenTexts
from pagedkv.serve.metrics import ServerMetrics
from pagedkv.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidField,
    error_body,
    validation_error_body,
)
from pagedkv.serve.responses import Job, collect, stream_events
from pagedkv.serve.sampling_fields import FieldError
from pagedkv.serve.structured_request import Parsers, compile_check, request_constraint
from pagedkv.serve.tools import template_messages


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
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

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
        self.parsers = Parsers(core.pm, self.tool_call_parser, self.enable_auto_tool_choice, self.reasoning_parser)


def build_app(state: ServerState) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it when the server shuts down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    app.state.pagedkv = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(list(exc.errors())), status_code=400)

    @app.exception_handler(InvalidField)
    async def _refused(request: Request, exc: InvalidField) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.status), status_code=exc.status)

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

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pagedkv",
                "max_model_len": state.max_model_len}
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.refuse_unsupported()
        prompts = [_encode_text(state, p) if isinstance(p, str) else _check_ids(state, p) for p in body.prompts()]
        explicit = "max_tokens" in body.model_fields_set
        structured = _fields(request_constraint, body, None, [])
        return await _answer(state, request, body, prompts, "prompt", body.max_tokens, explicit, chat=False,
                             structured=structured)

    @v1.post("/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        body.refuse_unsupported()
        tokenizer = state.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidField("messages", f"model {state.model_name!r} has no chat template, so it cannot answer "
                               "chat requests; use /v1/completions with a plain prompt")
        tools, choice = _fields(body.tool_setup)
        _fields(state.parsers.check_choice, choice)
        structured = _fields(request_constraint, body, choice, tools)
        text = tokenizer.apply_chat_template(
            template_messages(body.conversation()), tools=tools or None,
            add_generation_prompt=body.add_generation_prompt, tokenize=False,
        )
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        wanted = body.wanted_max_tokens()
        return await _answer(state, request, body, [ids], "messages", wanted, wanted is not None, chat=True,
                             structured=structured, shaper=state.parsers.shaper(choice))

    app.include_router(v1)
    return app


def _fields(check: Any, *args: Any) -> Any:
    """``check(*args)``, a ``FieldError`` answered 400 naming its field."""
    try:
        return check(*args)
    except FieldError as exc:
        raise InvalidField(exc.param, exc.message) from None


def _encode_text(state: ServerState, text: str) -> list[int]:
    if state.tokenizer is None:
        raise InvalidField("prompt", "this model has no tokenizer: give the prompt as token ids")
    return list(state.tokenizer(text)["input_ids"])


def _check_ids(state: ServerState, ids: list[int]) -> list[int]:
    if min(ids) < 0 or max(ids) >= state.vocab_size:
        raise InvalidField("prompt", f"prompt token ids must be in 0..{state.vocab_size - 1}")
    return list(ids)


async def _answer(state: ServerState, request: Request, body: Any, prompts: list[list[int]], prompt_field: str,
                  max_tokens: int | None, explicit: bool, chat: bool, structured: Any = (None, None),
                  shaper: Any = None) -> Response:
    if body.model not in (None, "", state.model_name):
        raise InvalidField("model", f"the model {body.model!r} does not exist; this server has "
                           f"{state.model_name!r}", 404, "not_found_error")
    limit = state.max_model_len
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise InvalidField(prompt_field, f"the prompt has {longest} tokens; this model's context is {limit} "
                           "tokens, which leaves no room for an answer")
    if max_tokens is None or not explicit:
        max_tokens = min(max_tokens or limit, limit - longest)
    elif longest + max_tokens > limit:
        raise InvalidField("max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens",
                           f"max_tokens ({max_tokens}) + the prompt ({longest} tokens) is above this model's "
                           f"context of {limit} tokens")
    try:
        params = body.sampling_params(max_tokens, state.vocab_size)
    except RequestRejected as exc:  # the engine's checks start their message with the field's name
        name = str(exc).split(" ", 1)[0]
        raise InvalidField(name if name in type(body).model_fields else None, str(exc)) from exc
    constraint, field = structured
    if constraint is not None:
        try:
            await compile_check(state.engine.engine, constraint, field)
        except FieldError as exc:
            raise InvalidField(exc.param, exc.message) from None
        params = dataclasses.replace(params, structured=constraint)
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    job = Job(chat, response_id, state.model_name, body.n, [], sum(map(len, prompts)),
              max((len(s) for s in params.stop), default=1) - 1, state.metrics, params.logprobs, state.token_texts,
              shaper)
    try:
        for index, ids in enumerate(prompts):
            job.handles.append(await state.engine.add(ids, params, f"{response_id}-{index}"))
    except QueueFull as exc:
        job.close()
        return JSONResponse(error_body(str(exc), "service_unavailable", code=503), status_code=503,
                            headers={"Retry-After": str(state.retry_after_s)})
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
        status, payload = await _unless_disconnected(request, collect(job))
    finally:
        job.close()
    if status is None:
        return Response(status_code=499)
    return JSONResponse(payload, status_code=status)


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
