"""Mistral format: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects, or (tokenizer
v11+) ``[TOOL_CALLS]name[ARGS]{...}`` per call; the text before the tag is content."""

from __future__ import annotations

import re

from pagedkv.serve.tool_parsers.base import Parsed, ToolCall, partial_suffix, scan_call_list, skip_space, value_end

TAG = "[TOOL_CALLS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(?=\{)")


class MistralToolParser:
    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(TAG)
        if first < 0:
            return Parsed(text if final else text[: len(text) - partial_suffix(text, TAG)])
        parsed = Parsed(text[:first])
        pos = skip_space(text, first + len(TAG))
        if pos < len(text) and text[pos] == "[":
            parsed.calls = scan_call_list(text, pos, final)
        else:
            while (match := _NAMED.match(text, pos)) is not None:
                args_start = match.end()
                end = value_end(text, args_start)
                parsed.calls.append(ToolCall(match.group(1), text[args_start:end], complete=end is not None))
                if end is None:
                    break
                pos = skip_space(text, end)
                if text.startswith(TAG, pos):
                    pos = skip_space(text, pos + len(TAG))
        if final and not parsed.calls:
            return Parsed(text)
        return parsed
