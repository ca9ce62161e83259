"""Structured outputs, tool calls and reasoning through a real ``engine serve`` and the OpenAI SDK (tiny random
model over the byte tokenizer: the grammar, not the model, makes the output valid)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from serve_helpers import MODEL, running_server

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": '
               r'\{"city": "[a-z]{3,6}", "unit": "(c|f)"\}\}</tool_call>')


class Person(BaseModel):
    name: str
    age: int
    tags: list[str]


def engine(thinking: bool = False) -> Engine:
    return Engine(EngineConfig(device="cpu", num_blocks=512, block_size=8),
                  model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1, max_position_embeddings=2048),
                  tokenizer=byte_tokenizer(thinking))


@pytest.fixture(scope="module")
def served():
    with running_server(engine(), tool_call_parser="hermes", enable_auto_tool_choice=True,
                        reasoning_parser=None) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_sdk_parse_with_a_pydantic_model(client):
    # string lengths are bounded by the budget, not the schema: a random model may ramble in a string
    for seed in range(3):
        completion = client.beta.chat.completions.parse(
            model=MODEL, messages=user("Who?"), response_format=Person, max_tokens=400, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": None})
        choice = completion.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(choice.message.parsed, Person)
            return
    pytest.fail("no parse finished inside the budget")


def test_response_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    for seed in range(5):
        chat = client.chat.completions.create(
            model=MODEL, messages=user("x"), max_tokens=60, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    text = client.completions.create(model=MODEL, prompt="x", max_tokens=60, temperature=1.0, seed=1,
                                     extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                         "name": "r", "schema": schema}}})
    jsonschema.validate(json.loads(text.choices[0].text), schema)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": r"[A-Z]{4}"}, lambda t: re.fullmatch(r"[A-Z]{4}", t)),
    ({"guided_json": {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
                      "additionalProperties": False}}, lambda t: json.loads(t)["a"] in (1, 2)),
    ({"structured_outputs": {"grammar": 'start: "<" /[a-c]{2}/ ">"'}}, lambda t: re.fullmatch("<[a-c]{2}>", t)),
])
def test_vllm_structured_outputs_and_legacy_guided_fields(client, extra, check):
    for seed in range(3):
        chat = client.chat.completions.create(model=MODEL, messages=user("x"), max_tokens=40, temperature=1.0,
                                              seed=seed, extra_body=extra)
        assert check(chat.choices[0].message.content), chat.choices[0].message.content
    text = client.completions.create(model=MODEL, prompt="x", max_tokens=40, temperature=1.0, extra_body=extra)
    assert check(text.choices[0].text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whatever": 1}}, "structured_outputs.whatever"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_constraints_answer_400_naming_the_field(served, body, param):
    response = httpx.post(served[0] + "/v1/chat/completions",
                          json={"model": MODEL, "messages": user("x"), "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert len(error["message"].splitlines()) == 1


def test_a_constraint_over_the_size_limit_answers_400_naming_the_field_and_the_limit(served):
    huge = 'start: "' + "ab" * 100_000 + '"'  # 200 kB: over the default --max-grammar-bytes (128 KiB)
    response = httpx.post(served[0] + "/v1/chat/completions",
                          json={"model": MODEL, "messages": user("x"), "max_tokens": 4, "guided_grammar": huge})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_grammar" and "--max-grammar-bytes" in error["message"], error


def test_named_tool_choice_then_a_tool_message_turn(client):
    messages = user("Weather in Paris?")
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=80, temperature=1.0, seed=2,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    follow = client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_tokens=8, temperature=0.0, tool_choice="none",
        messages=[*messages, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}])
    assert follow.choices[0].finish_reason in ("stop", "length")
    assert follow.usage.prompt_tokens > chat.usage.prompt_tokens + len('{"temp": 21}')  # the history was rendered


def test_required_tool_choice_gives_valid_calls(client):
    for seed in range(3):
        chat = client.chat.completions.create(model=MODEL, messages=user("x"), tools=TOOLS, tool_choice="required",
                                              max_tokens=200, temperature=1.0, seed=seed)
        choice = chat.choices[0]
        if choice.finish_reason == "length":
            continue
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), schema)
        return
    pytest.fail("no required call finished inside the budget")


def _streamed_calls(client, **kwargs):
    calls: dict[int, dict] = {}
    finish, content, pieces = None, "", 0
    for chunk in client.chat.completions.create(model=MODEL, messages=user("x"), stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            slot = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            slot["id"] = slot["id"] or part.id
            slot["name"] = slot["name"] or (part.function.name if part.function else None)
            slot["arguments"] += (part.function.arguments or "") if part.function else ""
            pieces += 1
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish, content, pieces


def test_streamed_named_tool_call_is_the_non_streamed_call_sent_whole(client):
    kwargs = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
                  temperature=1.0, seed=4)
    calls, finish, content, pieces = _streamed_calls(client, **kwargs)
    whole = client.chat.completions.create(model=MODEL, messages=user("x"), **kwargs).choices[0].message
    assert finish == "tool_calls" and content == ""
    assert pieces == 1  # a call goes out once it is known complete and valid, so a stream never takes one back
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls]


def test_auto_tool_choice_parses_a_hermes_call_streamed_or_not(client):
    """The grammar makes the random model write a hermes call; the server's parser must find it."""
    kwargs = dict(tools=TOOLS, max_tokens=120, temperature=1.0, seed=5,
                  extra_body={"structured_outputs": {"regex": r"Sure\. " + HERMES_CALL}})
    chat = client.chat.completions.create(model=MODEL, messages=user("x"), **kwargs)
    message = chat.choices[0].message
    assert chat.choices[0].finish_reason == "tool_calls"
    assert message.content == "Sure. "
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls, finish, content, pieces = _streamed_calls(client, **kwargs)
    assert finish == "tool_calls" and content == "Sure. " and pieces == 1
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_sdk_stream_helper_accumulates_tool_calls(client):
    with client.beta.chat.completions.stream(
            model=MODEL, messages=user("x"), tools=TOOLS, max_tokens=80, temperature=1.0, seed=6,
            tool_choice={"type": "function", "function": {"name": "get_time"}}) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")


def test_auto_tool_choice_needs_the_server_flags():
    with running_server(engine()) as (url, _):
        response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user("x"),
                                                                  "tools": TOOLS, "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
        ok = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": user("x"), "tools": TOOLS,
                                                            "tool_choice": "none", "max_tokens": 2})
        assert ok.status_code == 200 and "tool_calls" not in ok.json()["choices"][0]["message"]


def test_reasoning_parser_splits_thinking_streamed_or_not():
    with running_server(engine(thinking=True), reasoning_parser="deepseek_r1") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        # the grammar applies after </think>, which a bias on its token (258) makes come after a few tokens
        kwargs = dict(model=MODEL, messages=user("x"), max_tokens=80, temperature=1.0, seed=5, logit_bias={"258": 3.0},
                      extra_body={"structured_outputs": {"regex": "[a-z]{3,6}"}})
        chat = client.chat.completions.create(**kwargs)
        message = chat.choices[0].message.model_dump()
        assert message["reasoning_content"] and re.fullmatch("[a-z]{3,6}", message["content"])
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
        assert (reasoning, content) == (message["reasoning_content"], message["content"])
