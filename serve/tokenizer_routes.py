"""vLLM's small routes beside the OpenAI API: ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

Shapes are vLLM's (the bodies are ``serve/api/tokenize_request.py``): ``/tokenize`` answers ``{count,
max_model_len, tokens, token_strs}``, counting the tokens the generation routes would (chats through
the same chat template); ``/detokenize`` answers ``{prompt}``. Unlike vLLM, they sit behind
``--api-key`` when one is set.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Depends, FastAPI, Request

from pagedkv.serve.api.chat import render_chat
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.tokenize_request import DetokenizeRequest, TokenizeRequest
from pagedkv.serve.http.admission import bounded_ids, chat_text, check_chars, validated_body


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
        check_model(body.model)
        body.check_rules()
        if body.prompt is not None:
            check_chars("prompt", len(body.prompt), state)
        text = None  # a request's own chat template renders in the sandbox, off the tokenizer's thread
        if body.messages is not None:
            text = await chat_text(state, body, body.conversation(), body.template_arguments())
        return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, _tokenize, body, text)

    def _tokenize(body: TokenizeRequest, text: str | None) -> dict[str, Any]:
        try:
            ids = _ids(body, text)
            if len(ids) > state.max_model_len:
                field = "prompt" if body.prompt is not None else "messages"
                raise InvalidField(field, f"the {field} has {len(ids):,} tokens, more than this model's context of "
                                   f"{state.max_model_len} tokens")
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

    def _ids(body: TokenizeRequest, text: str | None) -> list[int]:
        # as vLLM's, a text over the context is refused (and tokenized in bounded prefixes until that is known)
        if body.prompt is not None:
            if state.tokenizer is None:
                encode_text(state, body.prompt)  # its 400
            return bounded_ids("prompt", state.tokenizer, body.prompt, state.max_model_len, body.special_tokens())
        if text is None:
            text = render_chat(state.tokenizer, state.model_name, body.conversation(), body.template_arguments())
        return bounded_ids("messages", state.tokenizer, text, state.max_model_len, body.special_tokens())

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(request: Request) -> dict[str, Any]:
        # at most a context's worth of ids, counted before the body is parsed (vLLM refuses more too)
        body = await validated_body(state, request, DetokenizeRequest, state.max_model_len + 16, "tokens")
        check_model(body.model)
        if len(body.tokens) > state.max_model_len:
            raise InvalidField("tokens", f"{len(body.tokens):,} token ids are more than this model's context of "
                               f"{state.max_model_len} tokens")
        if body.tokens and (min(body.tokens) < 0 or max(body.tokens) >= state.vocab_size):
            raise InvalidField("tokens", f"token ids must be in 0..{state.vocab_size - 1}")
        return {"prompt": decode_ids(state, body.tokens)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def encode_text(state: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    if state.tokenizer is None:
        raise InvalidField("prompt", "this model has no tokenizer: give the prompt as token ids")
    return list(state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def decode_ids(state: Any, ids: list[int]) -> str:
    if state.tokenizer is None:
        raise InvalidField("tokens", "this model has no tokenizer")
    return state.tokenizer.decode(ids)
