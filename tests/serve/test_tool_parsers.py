"""Golden tests of the tool-call and reasoning parsers (no model): each format's calls and content, and the
streaming rule that every parse of a prefix is a prefix of the final parse, so deltas never take text back."""

from __future__ import annotations

import json

import pytest

from pagedkv.core.plugin.plugin_manager import build_registry, make_plugin_manager
from pagedkv.serve.chat_output import ChatDeltas, ChatShaper
from pagedkv.serve.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from pagedkv.serve.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedkv.serve.tool_parsers.hermes import HermesToolParser
from pagedkv.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedkv.serve.tool_parsers.mistral import MistralToolParser
from pagedkv.serve.tool_parsers.pythonic import PythonicToolParser

GOLDEN = [
    (HermesToolParser(), 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                         '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                         '</tool_call>',
     "Let me check.\n", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
    (HermesToolParser(), "No tools needed: 4.", "No tools needed: 4.", []),
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", {"x": 1})]),
    (Llama3JsonToolParser(), '{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}', "",
     [("get_weather", {"city": "Oslo", "days": [1, 2]})]),
    (Llama3JsonToolParser(), '<|python_tag|>{"name": "a", "parameters": {"k": "}{"}}; {"name": "b", "parameters": {}}',
     "", [("a", {"k": "}{"}), ("b", {})]),
    (Llama3JsonToolParser(), "The answer is {braces} later.", "The answer is {braces} later.", []),
    (PythonicToolParser(), '[get_weather(city="San Francisco", days=3), get_time(zone=None)]', "",
     [("get_weather", {"city": "San Francisco", "days": 3}), ("get_time", {"zone": None})]),
    (PythonicToolParser(), "[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    (PythonicToolParser(), "Just words.", "Just words.", []),
    (MistralToolParser(), 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                          '{"name": "get_time", "arguments": {"zone": "cet"}}]',
     "Sure ", [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "cet"})]),
    (MistralToolParser(), '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Lima"}), ("get_time", {})]),
    (MistralToolParser(), "Plain [answer].", "Plain [answer].", []),
    (RequiredToolParser(), '[{"name": "get_time", "parameters": {"zone": "utc"}}]', "",
     [("get_time", {"zone": "utc"})]),
    (NamedToolParser("get_weather"), '{"city": "Bern", "unit": "f"}', "",
     [("get_weather", {"city": "Bern", "unit": "f"})]),
]


def final_calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


@pytest.mark.parametrize("parser, text, content, calls", GOLDEN)
def test_golden_output(parser, text, content, calls):
    parsed = parser.parse(text, final=True)
    assert parsed.content == content
    assert final_calls(parsed) == calls
    assert all(c.complete for c in parsed.calls)


@pytest.mark.parametrize("parser, text, content, calls", GOLDEN)
def test_every_prefix_parses_to_a_prefix_of_the_final_answer(parser, text, content, calls):
    final = parser.parse(text, final=True)
    for end in range(len(text) + 1):
        partial = parser.parse(text[:end], final=False)
        assert final.content.startswith(partial.content), (end, partial.content)
        assert len(partial.calls) <= len(final.calls)
        for got, want in zip(partial.calls, final.calls):
            assert got.name == want.name
            assert want.arguments.startswith(got.arguments), (end, got.arguments)


@pytest.mark.parametrize("parser, text, content, calls", GOLDEN)
def test_streamed_deltas_reassemble_to_the_whole_message(parser, text, content, calls):
    shaper = ChatShaper(parser)
    deltas = ChatDeltas(shaper)
    streamed_content, streamed = "", {}
    for end in range(0, len(text) + 1, 3):
        piece = deltas.delta(text[:end], final=False)
        streamed_content += piece.get("content", "")
        for call in piece.get("tool_calls", ()):
            slot = streamed.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
            slot["arguments"] += call["function"].get("arguments", "")
    piece = deltas.delta(text, final=True)
    streamed_content += piece.get("content", "")
    for call in piece.get("tool_calls", ()):
        slot = streamed.setdefault(call["index"], {"name": call["function"].get("name"), "arguments": ""})
        slot["arguments"] += call["function"].get("arguments", "")
    message, has_calls = shaper.message(text)
    assert has_calls == bool(calls)
    assert streamed_content == (message["content"] or "")
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == whole


def test_a_partial_call_streams_its_name_before_its_arguments_end():
    parsed = HermesToolParser().parse('ok <tool_call>{"name": "get_weather", "arguments": {"city": "Pa', final=False)
    assert parsed.content == "ok "
    [call] = parsed.calls
    assert (call.name, call.arguments, call.complete) == ("get_weather", '{"city": "Pa', False)
    assert HermesToolParser().parse("ok <tool_", final=False).content == "ok "  # maybe a tag: held back


@pytest.mark.parametrize("parser, text, reasoning, content", [
    (DeepSeekR1ReasoningParser(), "<think>Two and two.</think>\n\nFour.", "Two and two.", "Four."),
    (DeepSeekR1ReasoningParser(), "Still thinking", "Still thinking", ""),
    (DeepSeekR1ReasoningParser(), "hmm</think>Yes", "hmm", "Yes"),
    (Qwen3ReasoningParser(), "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    (Qwen3ReasoningParser(), "Paris.", None, "Paris."),
])
def test_reasoning_split_golden_and_streamed(parser, text, reasoning, content):
    assert parser.split(text, final=True) == (reasoning, content)
    for end in range(len(text) + 1):
        got_reasoning, got_content = parser.split(text[:end], final=False)
        assert (reasoning or "").startswith(got_reasoning or ""), (end, got_reasoning)
        assert content.startswith(got_content), (end, got_content)


def test_reasoning_then_tool_calls_in_one_answer():
    shaper = ChatShaper(HermesToolParser(), Qwen3ReasoningParser())
    message, calls = shaper.message('<think>need weather</think><tool_call>{"name": "w", "arguments": {}}</tool_call>')
    assert calls and message["reasoning_content"] == "need weather" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "w", "arguments": "{}"}


def test_built_in_parsers_register_through_the_hooks():
    pm = make_plugin_manager()
    tools = build_registry(pm, "tool call parser", "pagedkv_register_tool_parsers")
    assert {"hermes", "llama3_json", "pythonic", "mistral"} <= set(tools.names())
    reasoning = build_registry(pm, "reasoning parser", "pagedkv_register_reasoning_parsers")
    assert {"deepseek_r1", "qwen3"} <= set(reasoning.names())
    assert build_registry(pm, "grammar backend", "pagedkv_register_grammar_backends").names() == ["guidance"]
