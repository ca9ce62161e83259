"""Admission work for one request, bounded and off the event loop: read the body, parse it, tokenize it.

The body is read up to ``max_request_bytes`` (413 as soon as it is over, 408 if it is too
slow); parsing and validation run on a worker thread; the tokenizer (the front end's own
copy, used from one worker thread only) sees a text only after a character check and then
in growing prefixes (``bounded_tokenize``), so no single request can stall the event loop,
and one that cannot fit the context costs work bounded by the context. Everything refused
here is an :class:`InvalidField`: a 4xx in OpenAI's error envelope naming the field.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from pagedkv.serve.api.chat import render_chat
from pagedkv.serve.api.errors import InvalidField, parse_body
from pagedkv.serve.api.json_body import parse_json_object
from pagedkv.serve.http.bounded_tokenize import TooManyTokens, tokenize_bounded
from pagedkv.serve.http.template_sandbox import request_template

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # --max-request-bytes
MIN_CHARS_PER_TOKEN_BOUND = 32  # see max_prompt_chars


async def read_body(state: Any, request: Request, held: list[int] | None = None) -> bytes:
    """The raw body, at most ``max_request_bytes`` (413 as soon as it is over), within ``body_timeout_s`` (408).

    With ``held`` (a one-item list), the bytes are taken from ``state.body_budget`` as they are read (the
    declared length first) and ``held[0]`` says how many: the caller gives them back when done with the body.
    """
    limit = state.max_request_bytes
    too_big = InvalidField(None, f"the request body is over this server's limit of {limit:,} bytes "
                           "(--max-request-bytes)", 413)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidField(None, "the Content-Length header is not a number")
        if int(declared) > limit:
            raise too_big
    chunks: list[bytes] = []
    size = 0

    async def reserve(total: int) -> None:
        if held is not None and total > held[0]:
            await state.body_budget.take(total - held[0])
            held[0] = total

    async def receive() -> None:
        nonlocal size
        if declared is not None:
            await reserve(int(declared))
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            await reserve(size)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), state.body_timeout_s)
    except asyncio.TimeoutError:
        raise InvalidField(None, f"the request body did not arrive within {state.body_timeout_s:g} s", 408) from None
    return b"".join(chunks)


def _validate(model: Any, raw: bytes) -> Any:
    """Parse and validate a body (on a worker thread): the request model, or InvalidField naming the field."""
    return parse_body(model, parse_json_object(raw))


async def validated_body(state: Any, request: Request, model: Any, max_items: int | None = None,
                         items_field: str | None = None) -> Any:
    """The body read within its limits and validated as ``model`` (its types and rules) off the event loop.

    Its bytes count against ``--max-inflight-body-bytes`` until it is parsed; ``max_items`` (with
    ``items_field``), when given, refuses a body with more JSON values than that before parsing it (its
    commas are counted: a list of ids is refused in milliseconds, not after seconds of ``json.loads``).
    """
    held = [0]
    try:
        raw = await read_body(state, request, held)
        state.bodies_read += 1
        if max_items is not None and raw.count(b",") >= max_items:
            raise InvalidField(items_field, f"the body has over {max_items:,} values; {items_field} may hold at "
                               f"most {max_items:,}")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(state.parse_pool, _validate, model, raw)
    finally:
        state.body_budget.give(held[0])


def max_prompt_chars(max_model_len: int, tokenizer: Any) -> int:
    """Characters above which a text cannot fit in ``max_model_len`` tokens, whatever it says.

    A token spells at most as many characters as its longest vocabulary entry (at least
    MIN_CHARS_PER_TOKEN_BOUND, for normalizers and byte-level spellings), so a longer text is
    refused before the tokenizer spends seconds on it.
    """
    longest = MIN_CHARS_PER_TOKEN_BOUND
    try:
        longest = max(longest, max(map(len, tokenizer.get_vocab())))
    except Exception:  # noqa: BLE001 - no vocabulary to read: the floor holds
        pass
    return max_model_len * longest


def check_chars(field: str, chars: int, state: Any) -> None:
    if chars > state.max_prompt_chars:
        raise InvalidField(field, f"the {field} has {chars:,} characters, more than can fit in this model's "
                           f"context of {state.max_model_len} tokens")


def encode_prompts(tokenizer: Any, prompts: list[str | list[int]], limit: int,
                   add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of every prompt (on the tokenizer's thread); text the tokenizer cannot take is a 400."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append(bounded_ids("prompt", tokenizer, prompt, limit, add_special_tokens))
        else:
            out.append(list(prompt))
    return out


def bounded_ids(field: str, tokenizer: Any, text: str, limit: int, add_special_tokens: bool) -> list[int]:
    try:
        return tokenize_bounded(tokenizer, text, limit, add_special_tokens)
    except TooManyTokens as exc:
        raise InvalidField(field, f"the {field} has at least {exc.tokens} tokens; this model's context is {limit} "
                           "tokens, which leaves no room for an answer") from None
    except Exception as exc:  # noqa: BLE001 - the client's text, not the server, is at fault
        raise InvalidField(field, f"the tokenizer cannot take this {field}: {type(exc).__name__}") from None


def encode_chat(state: Any, conversation: list[dict[str, Any]], template_arguments: dict[str, Any],
                add_special_tokens: bool) -> list[int]:
    """The conversation through the model's chat template, as token ids (on the tokenizer's thread)."""
    text = render_chat(state.tokenizer, state.model_name, conversation, template_arguments)
    return bounded_ids("messages", state.tokenizer, text, state.max_model_len, add_special_tokens)


async def chat_text(state: Any, body: Any, conversation: list[dict[str, Any]],
                    template_arguments: dict[str, Any]) -> str | None:
    """The conversation rendered by the request's own chat template in the sandbox; None when the request
    has none (the model's template renders it on the tokenizer's thread). A 400 when the server does not
    trust request templates (``template_sandbox``)."""
    found = request_template(body, state.templates is not None)
    if found is None:
        return None
    if state.tokenizer is None:
        raise InvalidField("messages", "this model has no tokenizer: give the prompt as token ids")
    return await state.templates.render(found[0], conversation, template_arguments)


async def encode_chat_request(state: Any, body: Any, conversation: list[dict[str, Any]],
                              template_arguments: dict[str, Any], add_special_tokens: bool) -> list[int]:
    """The token ids of a chat request: through its own template (sandboxed) or the model's."""
    loop = asyncio.get_running_loop()
    text = await chat_text(state, body, conversation, template_arguments)
    if text is None:
        return await loop.run_in_executor(state.tokenize_pool, encode_chat, state, conversation, template_arguments,
                                          add_special_tokens)
    return await loop.run_in_executor(state.tokenize_pool, bounded_ids, "messages", state.tokenizer, text,
                                      state.max_model_len, add_special_tokens)


def check_ids(state: Any, ids: list[int]) -> list[int]:
    if len(ids) >= state.max_model_len:
        raise InvalidField("prompt", f"the prompt has {len(ids)} tokens; this model's context is "
                           f"{state.max_model_len} tokens, which leaves no room for an answer")
    if min(ids) < 0 or max(ids) >= state.vocab_size:
        raise InvalidField("prompt", f"prompt token ids must be in 0..{state.vocab_size - 1}")
    return list(ids)
