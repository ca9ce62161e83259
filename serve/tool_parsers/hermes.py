"""Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them;
the text before the first tag is content."""

from __future__ import annotations

from pagedkv.serve.tool_parsers.base import Parsed, partial_suffix, scan_call, skip_space

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser:
    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(OPEN)
        if first < 0:
            return Parsed(text if final else text[: len(text) - partial_suffix(text, OPEN)])
        parsed = Parsed(text[:first])
        pos = first
        while pos >= 0:
            body = skip_space(text, pos + len(OPEN))
            close = text.find(CLOSE, body)
            segment = text[: close if close >= 0 else len(text)]
            if body < len(segment) and segment[body] == "{":
                call, _ = scan_call(segment, body, final or close >= 0)
                if call is not None:
                    call.complete = call.complete and (close >= 0 or final)
                    parsed.calls.append(call)
            if close < 0:
                break
            pos = text.find(OPEN, close + len(CLOSE))
        if final and not parsed.calls:
            return Parsed(text)
        return parsed
