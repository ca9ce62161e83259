"""Chat templates rendered as transformers 5 renders them, on ``jinja2`` alone (no transformers import).

The environment is transformers': sandboxed and immutable, ``trim_blocks``, ``lstrip_blocks``, the
loop controls, its ``tojson`` (no HTML escaping, ``ensure_ascii=False``), ``raise_exception``,
``strftime_now``, a ``dict`` and a ``namespace`` that refuse underscore names; the special tokens
are passed in, the caller's keyword arguments over them; messages lose their None-valued keys and
get the reasoning aliases. Only plain JSON data in one conversation is rendered here;
:func:`render_chat` returns None for anything else (documents, ``continue_final_message``,
assistant masks, objects, ``{% generation %}``), and the caller asks transformers.
:func:`render_json_chat` renders all of those for JSON data (a request's), as transformers does without
assistant masks, and stops as soon as the text passes a length: the server's sandbox for clients' templates.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

# apply_chat_template's own parameters: given any of them, transformers renders (or tokenizes).
_TRANSFORMERS_ONLY = frozenset({
    "documents", "continue_final_message", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# {% generation %} blocks only mark assistant text for masks: without masks they are plain blocks (same whitespace)
_GENERATION_OPEN = re.compile(r"\{%(-?)\s*generation\s*(-?)%\}")
_GENERATION_CLOSE = re.compile(r"\{%(-?)\s*endgeneration\s*(-?)%\}")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker for the end of the message to continue


def _plain(value: Any) -> bool:
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if type(value) is list:
        return all(_plain(v) for v in value)
    return False


def _copy(value: Any) -> Any:
    if type(value) is dict:
        return {k: _copy(v) for k, v in value.items()}
    if type(value) is list:
        return [_copy(v) for v in value]
    return value


def _message(message: dict[str, Any]) -> dict[str, Any]:
    message = {k: _copy(v) for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


@functools.lru_cache(maxsize=16)
def compiled(template: str) -> Any:
    """``template`` compiled in transformers' chat environment (cached: a server renders one template often)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class TemplateDict:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def render_chat(template: str, conversation: Any, tools: Any, add_generation_prompt: bool,
                variables: dict[str, Any]) -> str | None:
    """The rendered text, or None when transformers must render this call (see the module docstring)."""
    # apply_chat_template's own parameters at their defaults (all falsy) change nothing: not template variables
    variables = {k: v for k, v in variables.items() if k not in _TRANSFORMERS_ONLY or v}
    if (_TRANSFORMERS_ONLY & set(variables) or type(conversation) is not list or not conversation
            or any(type(m) is not dict for m in conversation) or not _plain(conversation)
            or not (tools is None or (type(tools) is list and all(type(t) is dict for t in tools) and _plain(tools)))
            or not _plain(variables) or _GENERATION_TAG.search(template)):
        return None
    return compiled(template).render(
        messages=[_message(m) for m in conversation], tools=_copy(tools), documents=None,
        add_generation_prompt=add_generation_prompt, **{k: _copy(v) for k, v in variables.items()})


class RenderTooLong(ValueError):
    """The rendered text passed ``max_chars`` (``chars`` is how far it got)."""

    def __init__(self, chars: int) -> None:
        super().__init__(f"the rendered text passed {chars:,} characters")
        self.chars = chars


def render_json_chat(template: str, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     documents: list[dict[str, Any]] | None, add_generation_prompt: bool,
                     continue_final_message: bool, variables: dict[str, Any], max_chars: int) -> str:
    """What transformers' ``apply_chat_template(tokenize=False)`` renders for JSON data, at most ``max_chars``.

    Raises :class:`RenderTooLong` as soon as the output passes ``max_chars`` (the text is produced in
    pieces, so a long loop stops there), ``ValueError`` for what transformers refuses, and jinja's errors.
    """
    variables = {k: _copy(v) for k, v in variables.items() if k not in _TRANSFORMERS_ONLY}
    messages = [_message(m) for m in conversation]
    final = None
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise ValueError('continue_final_message is set but the final message has no "content" to continue')
        if "content" not in template:
            raise ValueError('continue_final_message is set to "content" but this is not an accepted field in '
                             "the chat_template")
        messages[-1]["content"] = final + _CONTINUE_TAG
    source = _GENERATION_CLOSE.sub(r"{%\1 endif \2%}", _GENERATION_OPEN.sub(r"{%\1 if true \2%}", template))
    pieces, size = [], 0
    for piece in compiled(source).generate(messages=messages, tools=_copy(tools), documents=_copy(documents),
                                           add_generation_prompt=add_generation_prompt, **variables):
        size += len(piece)
        if size > max_chars:
            raise RenderTooLong(size)
        pieces.append(piece)
    text = "".join(pieces)
    return text if final is None else _cut_at_continue_tag(text, final)


def _cut_at_continue_tag(text: str, final: str) -> str:
    """The text up to the end of the final message (transformers' rule, spacing included)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
