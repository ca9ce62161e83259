"""Pythonic format (Llama 3.2 / 4): the answer is a Python list of calls, ``[get_weather(city="Paris"), f()]``,
keyword arguments as literals. The calls are read with ``ast`` once the list is complete, so they stream
whole; an answer that is not such a list is content."""

from __future__ import annotations

import ast
import json

from pagedkv.serve.tool_parsers.base import Parsed, ToolCall

WRAP = ("<|python_start|>", "<|python_end|>")


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _calls(source: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        name = _name(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args or any(k.arg is None for k in node.keywords):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
    return calls


class PythonicToolParser:
    def parse(self, text: str, final: bool) -> Parsed:
        source = text.strip()
        for tag in WRAP:
            source = source.replace(tag, "")
        source = source.strip()
        if not source:
            return Parsed(text if final else "")
        if not source.startswith("["):
            return Parsed(text if final or not WRAP[0].startswith(source) else "")
        calls = _calls(source)
        if calls is not None:
            return Parsed("", calls)
        return Parsed(text if final else "")
