"""A request's answer shape and constraint, decided on the asyncio side before anything is queued.

``Parsers`` picks how a chat answer is parsed (tool calls, reasoning) from the server's parsers and the
request's ``tool_choice``. The constraint (``GenerationRequest.constraint``) is compiled here, on the
engine's compile workers and awaited (the engine reuses the compiled grammar), so a schema the backend
cannot compile answers 400 naming its field and the step loop never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from typing import Any

from pagedkv.core.errors import RequestRejected
from pagedkv.core.plugin.plugin_manager import build_registry
from pagedkv.core.sample.grammar_compiler import result_of
from pagedkv.core.sample.reasoning_gate import ended_in
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.serve.api.errors import InvalidField
from pagedkv.serve.api.tools import ToolChoice
from pagedkv.serve.chat_output import ChatShaper
from pagedkv.serve.tool_parsers.forced import NamedToolParser, RequiredToolParser


class Parsers:
    """The server's tool-call and reasoning parser factories, looked up once at start-up (a bad name fails then)."""

    def __init__(self, pm: Any, tool_call_parser: str | None, auto_tool_choice: bool,
                 reasoning_parser: str | None, tokenizer: Any = None) -> None:
        self.tool_call_parser = tool_call_parser
        self.auto_tool_choice = auto_tool_choice
        self.tool_factory = self.reasoning_factory = None
        if tool_call_parser:
            self.tool_factory = build_registry(pm, "tool call parser", "pagedkv_register_tool_parsers").get(
                tool_call_parser).factory
        if reasoning_parser:
            self.reasoning_factory = build_registry(pm, "reasoning parser", "pagedkv_register_reasoning_parsers").get(
                reasoning_parser).factory
        # the reasoning's markers as token ids (a grammar waits for the end one); () when unknown
        self.markers: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        if self.reasoning_factory is not None and tokenizer is not None:
            parser = self.reasoning_factory()
            self.markers = tuple(  # type: ignore[assignment]
                tuple(tokenizer.encode(mark, add_special_tokens=False)) if isinstance(mark, str) and mark else ()
                for mark in (getattr(parser, "start", None), getattr(parser, "end", None)))

    def shaper(self, choice: ToolChoice | None, tools: list[dict[str, Any]] | None = None) -> ChatShaper | None:
        """How a chat answer is parsed (None: all of it is content); a call must name one of ``tools``."""
        tool_factory: Any = None
        if choice is not None and choice.mode == "named":
            tool_factory = functools.partial(NamedToolParser, choice.name or "")
        elif choice is not None and choice.mode == "required":
            tool_factory = RequiredToolParser
        elif choice is not None and choice.mode == "auto" and self.tool_factory is not None:
            tool_factory = self.tool_factory
        if tool_factory is None and self.reasoning_factory is None:
            return None
        names = [t["function"]["name"] for t in tools or ()]
        return ChatShaper(tool_factory, self.reasoning_factory, names)

    def after_reasoning(self, shaper: ChatShaper | None, constraint: StructuredOutputs | None,
                        prompt: list[int]) -> tuple[ChatShaper | None, StructuredOutputs | None]:
        """With a reasoning parser: the constraint waits for the reasoning's end, as in vLLM; a prompt whose
        reasoning is already closed (``enable_thinking: false``) has an answer of content only."""
        start, end = self.markers
        if shaper is None or shaper.reasoning_factory is None or not end:
            return shaper, constraint
        if constraint is not None:
            constraint = dataclasses.replace(constraint, reasoning_start=start, reasoning_end=end)
        if ended_in(prompt, start, end):
            shaper = shaper.without_reasoning()
        return shaper, constraint

    def check_choice(self, choice: ToolChoice) -> None:
        if choice.mode == "auto" and not (self.auto_tool_choice and self.tool_factory is not None):
            raise InvalidField("tool_choice", '"auto" tool choice needs the server started with '
                                            "--enable-auto-tool-choice and --tool-call-parser")


async def compile_check(engine: Any, constraint: StructuredOutputs | None, field: str | None,
                        client: str = "") -> None:
    """Compile in a worker thread; an uncompilable constraint (too big, too slow, invalid) raises
    ``InvalidField`` naming ``field``. ``client`` (the peer's address) gets fair turns on the compile workers."""
    if constraint is None:
        return
    try:
        future = engine.submit_structured(constraint, client)
        if not future.done():  # awaited, not waited for on a worker thread: slow compiles hold no thread here
            with contextlib.suppress(Exception):  # read below; shielded: a disconnect must not cancel a shared compile
                await asyncio.shield(asyncio.wrap_future(future))
        result_of(future)
    except RequestRejected as exc:
        field = field or "structured_outputs"
        raise InvalidField(field, str(exc).replace("structured_outputs", field, 1)) from None
