"""vLLM's small routes beside the OpenAI API: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

Shapes are vLLM's: ``/tokenize`` takes a completions-style ``prompt`` or a chat ``messages`` list
(through the chat template, as the chat route renders it) and answers ``{count, max_model_len,
tokens, token_strs}``; ``/detokenize`` takes ``tokens`` and answers ``{prompt}``. Unlike vLLM,
they sit behind ``--api-key`` when one is set.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Depends, FastAPI, Request
from pydantic import Field

from pagedkv.serve.admission import validated_body
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.prompt_render import chat_ids, decode_ids, encode_text
from pagedkv.serve.protocol import ChatMessage, StrictBody


class TokenizeRequest(StrictBody):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: exactly one of prompt / messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: Any = None
    mm_processor_kwargs: Any = None


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def add_tokenizer_routes(app: FastAPI, state: Any, check_key: Any) -> None:
    """Register /tokenize, /detokenize and /version on ``app``.

    Bodies are read and validated as the generation routes' are (size limit, strict types, off the
    event loop); tokenizing runs on the tokenizer's thread.
    """
    from pagedkv import __version__

    def check_model(name: str | None) -> None:
        if name not in (None, "", *state.served_model_names):
            raise InvalidField("model", f"the model {name!r} does not exist; this server has {state.model_name!r}",
                               404, "not_found_error")

    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await validated_body(state, request, TokenizeRequest)
        return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, _tokenize, body)

    def _tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        for name in ("tools", "mm_processor_kwargs"):
            if getattr(body, name) is not None:
                raise InvalidField(name, f"{name} is not supported by pagedkv")
        if (body.prompt is None) == (body.messages is None):
            raise InvalidField("prompt", "give exactly one of prompt and messages")
        try:
            ids = _ids(body)
        except InvalidField:
            raise
        except Exception as exc:  # noqa: BLE001 - the client's text (a lone surrogate, ...), not the server, is at fault
            raise InvalidField("prompt" if body.prompt is not None else "messages",
                               f"the tokenizer cannot take this input: {type(exc).__name__}") from None
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                                  "token_strs": None}
        if body.return_token_strs:
            answer["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return answer

    def _ids(body: TokenizeRequest) -> list[int]:
        if body.prompt is not None:
            return encode_text(state, body.prompt, True if body.add_special_tokens is None else body.add_special_tokens)
        if body.continue_final_message and body.add_generation_prompt and "add_generation_prompt" in \
                body.model_fields_set:
            raise InvalidField("continue_final_message", "continue_final_message and add_generation_prompt "
                               "cannot both be true")
        arguments: dict[str, Any] = dict(body.chat_template_kwargs or {})
        arguments["add_generation_prompt"] = body.add_generation_prompt and not body.continue_final_message
        arguments["continue_final_message"] = body.continue_final_message
        if body.chat_template is not None:
            arguments["chat_template"] = body.chat_template
        return chat_ids(state, [m.for_template() for m in body.messages or []], arguments,
                        bool(body.add_special_tokens))

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await validated_body(state, request, DetokenizeRequest)
        check_model(body.model)
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= state.vocab_size):
            raise InvalidField("tokens", f"token ids must be in 0..{state.vocab_size - 1}")
        return {"prompt": decode_ids(state, body.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}
