"""Tool and reasoning parsers behind a real server (issue 42, rows 5 and 7): a grammar makes the tiny random
model write exactly the text under test, so what the parsers do with hostile text, streamed or not, is seen
as a client sees it; and with a reasoning parser the grammar applies only after ``</think>``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from serve_helpers import MODEL, running_server

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
END_THINK = 258  # the id of </think> in byte_tokenizer(thinking=True)


def engine(thinking: bool = False) -> Engine:
    return Engine(EngineConfig(device="cpu", num_blocks=512, block_size=8),
                  model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1, max_position_embeddings=2048),
                  tokenizer=byte_tokenizer(thinking))


def chat(url: str, stream: bool = False, **body) -> tuple[int, dict]:
    """(status, the message, or for a stream the deltas added up, with ``finish_reason`` and ``done``)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 1.0, "seed": 1, **body}
    if not stream:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        if response.status_code != 200:
            return response.status_code, response.json()
        choice = response.json()["choices"][0]
        return 200, {**choice["message"], "finish_reason": choice["finish_reason"]}
    added = {"content": "", "reasoning_content": "", "tool_calls": [], "done": False}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                added["done"] = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                delta = choice["delta"]
                for key in ("content", "reasoning_content"):
                    added[key] += delta.get(key) or ""
                added["tool_calls"] += delta.get("tool_calls") or []
                added["finish_reason"] = choice["finish_reason"] or added.get("finish_reason")
    return response.status_code, added


def forced(text: str) -> dict:
    """A body field whose grammar makes the model write ``text`` exactly."""
    return {"structured_outputs": {"regex": "".join("\\" + c if c in r"\.^$*+?{}[]|()" else c for c in text)}}


@pytest.fixture(scope="module")
def pythonic():
    with running_server(engine(), tool_call_parser="pythonic", enable_auto_tool_choice=True) as (url, _):
        yield url


@pytest.fixture(scope="module")
def hermes():
    with running_server(engine(), tool_call_parser="hermes", enable_auto_tool_choice=True) as (url, _):
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_a_pythonic_set_argument_is_content_not_a_500(pythonic, stream):
    text = "[f(a={1,2})]"
    status, message = chat(pythonic, stream, tools=TOOLS, max_tokens=40, **forced(text))
    assert status == 200 and message["content"] == text and not message.get("tool_calls")
    assert message["finish_reason"] == "stop" and message.get("done", True)


@pytest.mark.parametrize("text", ['<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                                  '<tool_call>{"name": "f", "arguments": {"x": Infinity}}</tool_call>'])
@pytest.mark.parametrize("stream", [False, True])
def test_an_undeclared_tool_or_non_json_arguments_are_content(hermes, text, stream):
    status, message = chat(hermes, stream, tools=TOOLS, max_tokens=80, **forced(text))
    assert status == 200 and message["content"] == text and not message.get("tool_calls")
    assert message["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_is_content(hermes, stream):
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    status, message = chat(hermes, stream, tools=TOOLS, max_tokens=50, **forced(text))
    assert status == 200 and message["content"] == text[:50] and not message.get("tool_calls")
    assert message["finish_reason"] == "length"


@pytest.fixture(scope="module")
def thinking():
    with running_server(engine(thinking=True), tool_call_parser="hermes", enable_auto_tool_choice=True,
                        reasoning_parser="deepseek_r1") as (url, _):
        yield url


THINK_A_LITTLE = {"logit_bias": {str(END_THINK): 3.0}, "max_tokens": 120, "seed": 5}  # it thinks a few tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_applies_after_the_reasoning(thinking, stream):
    status, message = chat(thinking, stream, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}, **THINK_A_LITTLE)
    assert status == 200 and message["finish_reason"] == "stop", message
    jsonschema.validate(json.loads(message["content"]), CITY)
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]  # (unconstrained)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_after_the_reasoning_gives_tool_calls(thinking, stream):
    status, message = chat(thinking, stream, tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, **THINK_A_LITTLE)
    assert status == 200 and message["finish_reason"] == "tool_calls", message
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


def test_a_prompt_that_closed_the_reasoning_constrains_from_the_first_token(thinking):
    status, message = chat(thinking, chat_template_kwargs={"enable_thinking": False}, max_tokens=60,
                           response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}})
    assert status == 200 and message["finish_reason"] == "stop" and message["reasoning_content"] is None
    jsonschema.validate(json.loads(message["content"]), CITY)
