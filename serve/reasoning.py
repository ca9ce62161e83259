"""Reasoning parsers (``--reasoning-parser``): the thinking part of an answer goes to ``reasoning_content``.

Both split at ``</think>``. ``deepseek_r1``: the template opens ``<think>`` in the prompt, so everything up
to ``</think>`` is reasoning (all of it while no ``</think>`` has come). ``qwen3``: reasoning only when the
answer opens with ``<think>`` (with ``enable_thinking: false`` the template closes it in the prompt, and
the answer is all content). Like the tool parsers, a pure function of the text so far: while streaming,
text that may be the start of a tag is held back.
"""

from __future__ import annotations

from pagedkv.serve.tool_parsers.base import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


def _split_after_open(text: str, final: bool) -> tuple[str, str]:
    body = text.lstrip()
    if not final and len(body) < len(OPEN) and OPEN.startswith(body):
        return "", ""  # maybe the start of <think>: wait
    if body.startswith(OPEN):
        body = body[len(OPEN):]
    end = body.find(CLOSE)
    if end >= 0:
        return body[:end], body[end + len(CLOSE):].lstrip("\n")
    return (body if final else body[: len(body) - partial_suffix(body, CLOSE)]), ""


class DeepSeekR1ReasoningParser:
    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the text so far."""
        return _split_after_open(text, final)


class Qwen3ReasoningParser:
    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        head = text.lstrip()
        if head.startswith(OPEN):
            return _split_after_open(text, final)
        if not final and OPEN.startswith(head):
            return None, ""  # maybe the start of <think>: wait
        return None, text
