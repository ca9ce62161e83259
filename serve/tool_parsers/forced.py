"""The outputs of a forced ``tool_choice``, which a grammar made well-formed: a named function's arguments
(the whole text), or for ``required`` a JSON array of ``{"name", "parameters"}`` calls."""

from __future__ import annotations

from pagedkv.serve.tool_parsers.base import Parsed, ToolCall, scan_call_list, skip_space


class NamedToolParser:
    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_space(text, 0)
        if start >= len(text):
            return Parsed("")
        return Parsed("", [ToolCall(self.name, text[start:].rstrip() if final else text[start:], complete=final)])


class RequiredToolParser:
    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_space(text, 0)
        if start >= len(text) or text[start] != "[":
            return Parsed("")
        return Parsed("", scan_call_list(text, start, final))
