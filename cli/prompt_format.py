"""How ``engine run`` turns a prompt into tokens: the chat template when the model has one, else the raw text.

A base model's tokenizer has no chat template; running it as a chat model
would crash in transformers, so such a prompt goes in as written. ``--chat``
and ``--no-chat`` choose explicitly; ``--chat`` on a model without a template
is a clear error.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.errors import ConfigError


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def use_chat(tokenizer: Any, chat: bool | None) -> bool:
    """Whether prompts are wrapped in the chat template: ``chat`` if given, else whether there is one."""
    if chat is None:
        return has_chat_template(tokenizer)
    if chat and not has_chat_template(tokenizer):
        raise ConfigError(
            "--chat: this model's tokenizer has no chat template (a base model?); use --no-chat to send prompts "
            "as written"
        )
    return chat


def encode_run_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int] | str:
    """Token ids of a chat prompt ready for the answer, or the raw text (the engine tokenizes it)."""
    if not chat:
        return prompt
    from pagedkv.core.llm import apply_chat_template

    return apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
