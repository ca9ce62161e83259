"""Llama 3.x JSON format: the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``, several separated by ``;``); an answer that starts otherwise is content."""

from __future__ import annotations

from pagedkv.serve.tool_parsers.base import Parsed, scan_call, skip_space

TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_space(text, 0)
        if text.startswith(TAG, pos):
            pos = skip_space(text, pos + len(TAG))
        elif not final and TAG.startswith(text[pos:]):
            return Parsed("")  # nothing but (the start of) the tag so far
        if pos >= len(text):
            return Parsed(text if final else "")
        if text[pos] != "{":
            return Parsed(text)
        parsed = Parsed("")
        while pos < len(text) and text[pos] == "{":
            call, end = scan_call(text, pos, final)
            if call is not None:
                parsed.calls.append(call)
            if end is None:
                break
            pos = skip_space(text, end, ";")
        if final and (not parsed.calls or pos < len(text)):
            return Parsed(text)
        return parsed
