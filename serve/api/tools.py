"""OpenAI ``tools`` and ``tool_choice``: checked, and turned into what the template and the grammar need.

``tool_choice`` (vLLM's semantics): ``none`` renders the tools but parses nothing; ``auto`` (the default when
tools are given) lets the model answer or call, parsed from its text by the server's ``--tool-call-parser``;
``required`` constrains the output to a JSON array of ``{"name", "parameters"}`` calls, and a named function
to that function's arguments, both with a grammar, so the calls always parse. Such a grammar is the
request's constraint: a ``response_format`` beside it is superseded (as in OpenAI's API and vLLM), while
vLLM's explicit ``structured_outputs`` / ``guided_*`` beside it are refused, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.serve.api.closed_schema import closed_schema
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.strict_body import StrictBody


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none, auto, required, named
    name: str | None = None  # the function, when named

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


class ToolFields(StrictBody):
    """On chat: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (accepted; several calls are parsed)."""

    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def tool_setup(self) -> tuple[list[dict[str, Any]], ToolChoice]:
        """(the checked tools, the choice); raises ``InvalidField``."""
        tools = check_tools(self.tools) if self.tools is not None else []
        return tools, tool_choice_of(self.tool_choice, tools)


class ToolMessageFields(StrictBody):
    """On a chat message: an assistant's earlier ``tool_calls`` and a tool result's ``tool_call_id``."""

    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The ``tools`` list, each ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``."""
    if not isinstance(tools, list):
        raise InvalidField("tools", "tools must be a list of function tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidField(where, f"{where} must be a function tool: {{'type': 'function', 'function': {{...}}}}")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidField(f"{where}.function.name", f"{where}.function needs a name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidField(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema")
        if function["name"] in seen:
            raise InvalidField(f"{where}.function.name", f"tool {function['name']!r} is defined twice")
        seen.add(function["name"])
    return tools


def tool_choice_of(choice: Any, tools: list[dict[str, Any]]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise InvalidField("tool_choice", f"tool_choice {choice!r} needs tools")
        return ToolChoice(choice)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise InvalidField("tool_choice", "tool_choice must be none, auto, required or "
                                        "{'type': 'function', 'function': {'name': ...}}")
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidField("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return ToolChoice("named", name)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object"}


def forced_constraint(choice: ToolChoice, tools: list[dict[str, Any]], allow_additional_properties: bool = False
                      ) -> StructuredOutputs | None:
    """The grammar of a ``required`` or named choice (None otherwise); the parameters' schemas are closed to
    unlisted keys unless ``allow_additional_properties``."""
    def parameters(tool: dict[str, Any]) -> dict[str, Any]:
        schema = _parameters(tool)
        return schema if allow_additional_properties else closed_schema(schema)

    if choice.mode == "named":
        tool = next(t for t in tools if t["function"]["name"] == choice.name)
        return StructuredOutputs(json=parameters(tool))
    if choice.mode != "required":
        return None
    schemas, definitions = _hoisted_definitions([parameters(t) for t in tools])
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False} for t, schema in zip(tools, schemas)]
    return StructuredOutputs(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}, **definitions})


def _hoisted_definitions(schemas: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The schemas without their ``$defs`` / ``definitions``, and those merged for the root of the ``required``
    array: a ``#/$defs/X`` reference resolves from the document's root, which is no longer the tool's parameters
    (Pydantic models with nested models give such references). As vLLM does; one name defined two ways is refused."""
    merged: dict[str, dict[str, Any]] = {}
    stripped = []
    for schema in schemas:
        stripped.append({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
        for keyword in ("$defs", "definitions"):
            for name, definition in (schema.get(keyword) or {}).items():
                if merged.setdefault(keyword, {}).setdefault(name, definition) != definition:
                    raise InvalidField("tools", f"tools define {keyword}/{name} in two different ways; "
                                                "tool_choice required needs one schema per name")
    return stripped, merged


def combined_constraint(structured: StructuredOutputs | None, field: str | None, choice: ToolChoice | None,
                        tools: list[dict[str, Any]], allow_additional_properties: bool = False
                        ) -> tuple[StructuredOutputs | None, str | None]:
    """A body's own constraint, or a forced tool choice's, with the field it came from. A forced choice's
    grammar supersedes ``response_format``; an explicit grammar field beside it is refused."""
    forced = forced_constraint(choice, tools, allow_additional_properties) if choice is not None else None
    if forced is not None:
        if structured is not None and field != "response_format":
            raise InvalidField(field, f"{field} cannot be combined with tool_choice "
                                      f"{choice.mode if choice else ''}: the tool choice sets the grammar")
        return forced, "tool_choice"
    return structured, field
