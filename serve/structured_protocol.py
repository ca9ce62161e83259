"""The request-body fields of structured outputs and tool calling, as pydantic mixins for ``protocol``.

Values are checked by ``structured_fields`` and ``tools`` (plain Python, shared with batch files); these
classes only declare the fields, so a bad value answers 400 naming its field either way.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.serve.strict_body import StrictBody
from pagedkv.serve.structured_fields import FIELDS, structured_from_body
from pagedkv.serve.tools import ToolChoice, check_tools, tool_choice_of


class StructuredFields(StrictBody):
    """On completions and chat: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # auto or guidance only: the server's backend compiles
    guided_whitespace_pattern: str | None = None

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """(the constraint, the field naming it); raises ``InvalidField``."""
        return structured_from_body(self.model_dump(include=set(FIELDS)))


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

    def tool_keys(self) -> dict[str, Any]:
        """The keys the chat template sees besides role and content."""
        return {k: v for k, v in (("tool_calls", self.tool_calls), ("tool_call_id", self.tool_call_id)) if v}
