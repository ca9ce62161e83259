"""The tool-call and reasoning parsers (no model): each format's calls and content, the rule that a call is
returned only for a declared tool with complete, strict JSON arguments (anything else is content, nothing
raises), and that a stream cut anywhere adds up to the non-streamed answer."""

from __future__ import annotations

import json
import random
import time

import pytest

from pagedkv.core.plugin.plugin_manager import build_registry, make_plugin_manager
from pagedkv.serve.chat_output import ChatDeltas, ChatShaper
from pagedkv.serve.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from pagedkv.serve.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedkv.serve.tool_parsers.hermes import HermesToolParser
from pagedkv.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedkv.serve.tool_parsers.mistral import MistralToolParser
from pagedkv.serve.tool_parsers.pythonic import PythonicToolParser

NAMES = ("get_weather", "get_time", "f", "a", "b", "w")
PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "pythonic": PythonicToolParser,
           "mistral": MistralToolParser, "required": RequiredToolParser,
           "named": lambda: NamedToolParser("get_weather")}

GOLDEN = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me check.\n\n", [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
    ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}', None,
     [("get_weather", {"city": "Oslo", "days": [1, 2]})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"k": "}{"}}; {"name": "b", "parameters": {}}',
     None, [("a", {"k": "}{"}), ("b", {})]),
    ("llama3_json", "The answer is {braces} later.", "The answer is {braces} later.", []),
    ("pythonic", '[get_weather(city="San Francisco", days=3), get_time(zone=None)]', None,
     [("get_weather", {"city": "San Francisco", "days": 3}), ("get_time", {"zone": None})]),
    ("pythonic", '<|python_start|>[f(a="]")]<|python_end|>', None, [("f", {"a": "]"})]),
    ("pythonic", "[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
    ("pythonic", "Just words.", "Just words.", []),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                '{"name": "get_time", "arguments": {"zone": "cet"}}]',
     "Sure ", [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "cet"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]get_time[ARGS]{}', None,
     [("get_weather", {"city": "Lima"}), ("get_time", {})]),
    ("mistral", "Plain [answer].", "Plain [answer].", []),
    ("required", '[{"name": "get_time", "parameters": {"zone": "utc"}}]', None, [("get_time", {"zone": "utc"})]),
    ("named", '{"city": "Bern", "unit": "f"}', None, [("get_weather", {"city": "Bern", "unit": "f"})]),
]

DEEP = "[" * 1000 + "]" * 1000
HOSTILE = [  # (parser, text): each is content, whole, and raises nothing
    ("pythonic", "[f(a={1,2})]"),
    ("pythonic", "[f(a=b'x')]"),
    ("pythonic", "[f(a=1e999)]"),
    ("pythonic", "[f(a=" + DEEP + ")]"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": ' + DEEP + "}}</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"x": ' + DEEP + "}}"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": ' + DEEP + "}}]"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": ' + DEEP + "}"),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'),  # a half call
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
    ("pythonic", '[get_weather(city="Par'),
    ("hermes", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # not a declared tool
    ("llama3_json", '{"name": "rm_rf", "parameters": {}}'),
    ("pythonic", "[rm_rf()]"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": Infinity}}</tool_call>'),  # not strict JSON
    ("llama3_json", '{"name": "f", "parameters": {"x": NaN}}'),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": -Infinity}'),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("named", '{"city": "Be'),  # a forced call cut by max_tokens
    ("required", '[{"name": "get_time", "parameters": {"zone": "ut'),
]


def streamed(shaper: ChatShaper, text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, str]], bool]:
    """(reasoning, content, calls, whether calls went out) of ``text`` streamed in pieces cut at ``cuts``."""
    deltas, reasoning, content, calls = ChatDeltas(shaper), "", "", []
    bounds = [0, *sorted(cuts), len(text)]
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        piece = deltas.delta(text[start:end], final=i == len(bounds) - 2)
        reasoning += piece.get("reasoning_content", "")
        content += piece.get("content", "")
        calls += [(c["function"]["name"], c["function"]["arguments"]) for c in piece.get("tool_calls", ())]
    return reasoning, content, calls, deltas.calls


def whole(shaper: ChatShaper, text: str) -> tuple[str, str, list[tuple[str, str]], bool]:
    message, has_calls = shaper.message(text)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())]
    return message.get("reasoning_content") or "", message["content"] or "", calls, has_calls


@pytest.mark.parametrize("name, text, content, calls", GOLDEN)
def test_golden_output(name, text, content, calls):
    message, has_calls = ChatShaper(PARSERS[name], tools=NAMES).message(text)
    assert message["content"] == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
            message.get("tool_calls", ())] == calls
    assert has_calls == bool(calls)


@pytest.mark.parametrize("name, text", HOSTILE)
def test_what_a_parser_cannot_take_as_a_call_is_content(name, text):
    message, has_calls = ChatShaper(PARSERS[name], tools=NAMES).message(text)
    assert (message["content"], has_calls) == (text, False)
    assert streamed(ChatShaper(PARSERS[name], tools=NAMES), text, list(range(1, len(text), 7)))[1:] == (
        text, [], False)


def test_a_call_names_a_declared_tool():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert ChatShaper(HermesToolParser, tools=["get_time"]).message(text)[1]
    assert not ChatShaper(HermesToolParser, tools=["get_weather"]).message(text)[1]


def _fragments(rng: random.Random) -> str:
    parts = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|python_start|>",
             "<|python_end|>", "<think>", "</think>", '{"name": "f", "arguments": {"x": 1}}',
             '{"name": "get_time", "parameters": {}}', "[f(a=1)]", "get_weather(city='x')", "{", "}", "[", "]",
             '"', "\\", ";", ",", "\n", " ", "Infinity", "NaN", '"name"', ":", "hello", "é", "🙂", "(", ")", "'"]
    return "".join(rng.choice(parts) for _ in range(rng.randint(0, 14)))


@pytest.mark.parametrize("name", [*PARSERS, None])
@pytest.mark.parametrize("reasoning", [None, DeepSeekR1ReasoningParser, Qwen3ReasoningParser])
def test_streamed_at_random_cuts_equals_the_whole_answer(name, reasoning):
    rng = random.Random(f"{name}{reasoning}")
    texts = [t for _, t, _, _ in GOLDEN] + [t for _, t in HOSTILE] + [_fragments(rng) for _ in range(300)]
    for text in texts:
        shaper = ChatShaper(PARSERS[name] if name else None, reasoning, tools=NAMES)
        want = whole(shaper, text)
        for _ in range(3):
            cuts = rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))) if len(text) > 1 else []
            assert streamed(shaper, text, cuts) == want, (text, cuts)


def test_llama3_json_streams_as_it_answers():
    text = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": Infinity}}'
    shaper = ChatShaper(Llama3JsonToolParser, tools=NAMES)
    assert streamed(shaper, text, [5, 40, 41]) == whole(shaper, text)
    assert whole(shaper, text)[1:3] == ('; {"name": "b", "parameters": {"y": Infinity}}', [("a", '{"x": 1}')])


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_a_long_streamed_answer_is_parsed_in_linear_time(name):
    """Each step's work is its new text: a 200k-character call streamed 2 characters a step takes about what
    one parse of the whole takes (re-parsing the whole text per step took minutes)."""
    filler = "x" * 200_000
    text = {"hermes": '<tool_call>{"name": "f", "arguments": {"s": "%s"}}</tool_call>',
            "llama3_json": '{"name": "f", "parameters": {"s": "%s"}}',
            "mistral": '[TOOL_CALLS]f[ARGS]{"s": "%s"}',
            "pythonic": '[f(s="%s")]'}[name] % filler
    shaper = ChatShaper(PARSERS[name], tools=NAMES)
    start = time.perf_counter()
    deltas, calls = ChatDeltas(shaper), []
    for i in range(0, len(text), 2):
        calls += deltas.delta(text[i:i + 2], final=False).get("tool_calls", [])
    calls += deltas.delta("", final=True).get("tool_calls", [])
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"s": filler}]
    assert time.perf_counter() - start < 20  # ~1 s here on a shared machine; the old re-parse took > 10 minutes


@pytest.mark.parametrize("name", [*PARSERS, None])
def test_a_long_run_of_whitespace_is_held_in_linear_time(name):
    """Whitespace before (or after) a tag is undecided text: 100k spaces streamed one a step stay cheap."""
    text = " " * 50_000 + "<|python_tag|>" + " " * 50_000 + "<think>" + "\n" * 50_000 + "x"
    shaper = ChatShaper(PARSERS[name] if name else None, Qwen3ReasoningParser, tools=NAMES)
    start = time.perf_counter()
    deltas, content = ChatDeltas(shaper), ""
    for i in range(len(text)):
        content += deltas.delta(text[i], final=False).get("content", "")
    content += deltas.delta("", final=True).get("content", "")
    assert content == whole(shaper, text)[1] == text
    assert time.perf_counter() - start < 20  # ~1 s here on a shared machine


def test_a_parser_that_raises_turns_the_rest_into_content():
    class Broken:
        def feed(self, text):
            raise RuntimeError("bug")

        def finish(self):
            raise RuntimeError("bug")

    message, has_calls = ChatShaper(Broken, tools=NAMES).message("<tool_call>{}</tool_call>")
    assert (message["content"], has_calls) == ("<tool_call>{}</tool_call>", False)


def test_a_whole_text_plugin_parser_still_works():
    class Bang:  # the older parse(text, final) API: called once, on the whole answer
        def parse(self, text, final):
            from pagedkv.serve.tool_parsers.base import Parsed, ToolCall
            name, _, args = text[1:].partition(" ")
            return Parsed("", [ToolCall(name, args)]) if text.startswith("!") else Parsed(text)

    shaper = ChatShaper(Bang, tools=NAMES)
    assert whole(shaper, '!f {"x": 1}')[1:] == ("", [("f", '{"x": 1}')], True)
    assert streamed(shaper, '!f {"x": 1}', [3]) == whole(shaper, '!f {"x": 1}')
    assert whole(shaper, "!rm {}")[1:] == ("!rm {}", [], False)


@pytest.mark.parametrize("parser, text, reasoning, content", [
    (DeepSeekR1ReasoningParser, "<think>Two and two.</think>\n\nFour.", "Two and two.", "Four."),
    (DeepSeekR1ReasoningParser, "Still thinking", "Still thinking", ""),
    (DeepSeekR1ReasoningParser, "hmm</think>Yes", "hmm", "Yes"),
    (Qwen3ReasoningParser, "<think>Let me see.</think>Paris.", "Let me see.", "Paris."),
    (Qwen3ReasoningParser, "Paris.", None, "Paris."),
])
def test_reasoning_split_golden_and_streamed(parser, text, reasoning, content):
    message, _ = ChatShaper(None, parser).message(text)
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert streamed(ChatShaper(None, parser), text, [cut] if 0 < cut < len(text) else []) == (
            reasoning or "", content, [], False)


def test_reasoning_then_tool_calls_in_one_answer():
    shaper = ChatShaper(HermesToolParser, Qwen3ReasoningParser, tools=["w"])
    message, calls = shaper.message('<think>need weather</think><tool_call>{"name": "w", "arguments": {}}</tool_call>')
    assert calls and message["reasoning_content"] == "need weather" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "w", "arguments": "{}"}


def test_a_prompt_that_closed_the_reasoning_leaves_all_content():
    shaper = ChatShaper(lambda: NamedToolParser("w"), DeepSeekR1ReasoningParser,
                        tools=["w"]).without_reasoning()
    message, calls = shaper.message('{"x": 1}')
    assert calls and message["reasoning_content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"x": 1}'}


def test_built_in_parsers_register_through_the_hooks():
    pm = make_plugin_manager()
    tools = build_registry(pm, "tool call parser", "pagedkv_register_tool_parsers")
    assert {"hermes", "llama3_json", "pythonic", "mistral"} <= set(tools.names())
    reasoning = build_registry(pm, "reasoning parser", "pagedkv_register_reasoning_parsers")
    assert {"deepseek_r1", "qwen3"} <= set(reasoning.names())
    assert build_registry(pm, "grammar backend", "pagedkv_register_grammar_backends").names() == ["guidance"]
