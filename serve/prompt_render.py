"""Prompts to token ids for the server's routes: text, token ids, and chats through the chat template.

Shared by the generation routes and ``/tokenize`` so both count the same tokens for the same input.
"""

from __future__ import annotations

from typing import Any

from pagedkv.serve.api.errors import InvalidField


def render_chat(state: Any, conversation: list[dict[str, Any]], template_arguments: dict[str, Any]) -> str:
    """The conversation through the chat template (the request's, else the server's), as text."""
    tokenizer = state.tokenizer
    if tokenizer is None or not (getattr(tokenizer, "chat_template", None) or template_arguments.get("chat_template")):
        raise InvalidField("messages", f"model {state.model_name!r} has no chat template, so it cannot answer "
                           "chat requests; use /v1/completions with a plain prompt")
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, **template_arguments)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's (continue_final_message on a user turn)
        raise InvalidField("messages", f"the chat template refused these messages: {type(exc).__name__}: "
                           f"{str(exc)[:200]}") from None


def chat_ids(state: Any, conversation: list[dict[str, Any]], template_arguments: dict[str, Any],
             add_special_tokens: bool) -> list[int]:
    """The conversation through the chat template, as token ids (``/tokenize``)."""
    text = render_chat(state, conversation, template_arguments)
    return list(state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_text(state: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    if state.tokenizer is None:
        raise InvalidField("prompt", "this model has no tokenizer: give the prompt as token ids")
    return list(state.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def decode_ids(state: Any, ids: list[int]) -> str:
    if state.tokenizer is None:
        raise InvalidField("tokens", "this model has no tokenizer")
    return state.tokenizer.decode(ids)
