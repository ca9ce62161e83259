"""``POST /v1/responses``: the OpenAI Responses API, stateless, served through the chat completion path.

The body is read and validated within the same limits as chat (``validated_body``), becomes the
equivalent chat request, is rendered and tokenized as chat is, and goes to the same answer path (model
check, context and queue limits, grammar compile check, admission, disconnect handling); only the answer
is re-spelt: a ``response`` object, or the Responses events. A refusal on the chat side names the
Responses field the client sent (``max_output_tokens``, ``input``, ``text.format``...).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.serve.answer_json import encode_json
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.responses_request import ResponsesRequest, responses_error
from pagedkv.serve.http.admission import check_chars, encode_chat_request, validated_body
from pagedkv.serve.responses_output import ResponseHead, response_from_chat
from pagedkv.serve.responses_stream import response_events

# the app's answer path: (state, request, chat body, prompts, prompt field, ...) -> the chat answer
Answer = Callable[..., Awaitable[Response]]


def add_responses_route(router: APIRouter, state: Any, answer: Answer,
                        guarded: Callable[[Any], Awaitable[Response]]) -> None:
    """``POST /responses`` on ``router`` (the app's /v1 router, behind its API key), answered through ``answer``."""

    @router.post("/responses")
    async def responses(request: Request) -> Response:
        return await guarded(_respond(state, request, answer))


async def _respond(state: Any, request: Request, answer: Answer) -> Response:
    body = await validated_body(state, request, ResponsesRequest)
    loop = asyncio.get_running_loop()
    chat = await loop.run_in_executor(state.parse_pool, body.to_chat)
    try:
        tools, choice = chat.tool_setup()
        state.parsers.check_choice(choice)
        structured = chat.constraint(choice, tools)
        conversation = chat.conversation()
        check_chars("messages", sum(len(m["content"]) for m in conversation), state)
        arguments = {**chat.template_arguments(), "tools": tools or None}
        ids = await encode_chat_request(state, chat, conversation, arguments, chat.add_special_tokens)
        answered = await answer(state, request, chat, [ids], "messages", structured=structured,
                                shaper=state.parsers.shaper(choice, tools))
    except InvalidField as exc:
        raise responses_error(exc) from None
    head = ResponseHead(body, state.model_name)
    if isinstance(answered, StreamingResponse):
        return StreamingResponse(response_events(head, answered.body_iterator), media_type="text/event-stream")
    if not isinstance(answered, JSONResponse) or answered.status_code != 200:
        return answered  # an error envelope (503 queue full, 500) or a client that left (499): as chat sends it
    # the chat answer is re-read and re-spelt off the event loop (a big one took the loop for as long as chat's
    # own encoding, which already runs on the answer pool)
    content = await loop.run_in_executor(state.answer_pool, _respelt, head, bytes(answered.body))
    return Response(content, media_type="application/json")


def _respelt(head: ResponseHead, chat_answer: bytes) -> bytes:
    """Chat's JSON answer as a Responses ``response`` object's JSON bytes (on a worker thread)."""
    return encode_json(response_from_chat(head, json.loads(chat_answer)))
