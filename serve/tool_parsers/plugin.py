"""Registers the built-in tool-call parsers (``--tool-call-parser NAME``)."""

from __future__ import annotations

from typing import Any

from pagedkv.core.hookspecs import hookimpl
from pagedkv.serve.tool_parsers.hermes import HermesToolParser
from pagedkv.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedkv.serve.tool_parsers.mistral import MistralToolParser
from pagedkv.serve.tool_parsers.pythonic import PythonicToolParser


@hookimpl
def pagedkv_register_tool_parsers(register: Any) -> None:
    register("hermes", HermesToolParser, "<tool_call>{json}</tool_call> (Hermes, Qwen 2.5/3)")
    register("llama3_json", Llama3JsonToolParser, '{"name": ..., "parameters": ...} (Llama 3.1/3.2 JSON)')
    register("pythonic", PythonicToolParser, "[f(a=1), g()] (Llama 3.2/4 pythonic)")
    register("mistral", MistralToolParser, "[TOOL_CALLS][{json}] or [TOOL_CALLS]name[ARGS]{json} (Mistral)")


@hookimpl
def pagedkv_register_reasoning_parsers(register: Any) -> None:
    from pagedkv.serve.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

    register("deepseek_r1", DeepSeekR1ReasoningParser, "thinking up to </think> (the template opens <think>)")
    register("qwen3", Qwen3ReasoningParser, "<think>...</think> when present, else all content")
