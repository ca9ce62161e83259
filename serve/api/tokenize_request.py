"""vLLM's ``/tokenize`` and ``/detokenize`` bodies.

``/tokenize`` takes a completions-style ``prompt`` or a chat ``messages`` list (rendered through
the chat template as the chat route renders it); ``/detokenize`` takes ``tokens``.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pagedkv.serve.api.chat import ChatMessage, ChatTemplateFields
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.strict_body import StrictBody

_REFUSED = ("tools", "mm_processor_kwargs")


class TokenizeRequest(ChatTemplateFields):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: exactly one of prompt / messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    return_token_strs: bool = False
    tools: Any = None
    mm_processor_kwargs: Any = None

    def check_rules(self) -> None:
        """The rules beyond the types (run after the model name is checked, so a wrong model answers 404)."""
        for name in _REFUSED:
            if getattr(self, name) is not None:
                raise InvalidField(name, f"{name} is not supported by pagedkv")
        if (self.prompt is None) == (self.messages is None):
            raise InvalidField("prompt", "give exactly one of prompt and messages")
        if self.messages is not None:
            self.check_generation_prompt()

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages or []]

    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.prompt is not None


class DetokenizeRequest(StrictBody):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)
