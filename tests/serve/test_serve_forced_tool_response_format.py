"""``response_format`` beside a ``required`` or named ``tool_choice`` (what the OpenAI Agents SDK sends for an agent
with an ``output_type`` and a required tool): accepted, and the tool's parameters schema, not the response
format, constrains the answer (tiny random model: the grammar forces the structure, the content is random)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import MODEL, running_server

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

# as pydantic and LangChain write them: additionalProperties left unset
LOOKUP = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
         {"type": "function", "function": {"name": "clock", "parameters": CLOCK}}]
SCHEMAS = {"lookup": LOOKUP, "clock": CLOCK}
# the agent's final output type: a schema the tool calls could never match
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "Final", "strict": True, "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
    "additionalProperties": False}}}
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "lookup"}}}


@pytest.fixture(scope="module")
def client():
    engine = Engine(EngineConfig(device="cpu", num_blocks=512, block_size=8),
                    model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1, max_position_embeddings=2048),
                    tokenizer=byte_tokenizer())
    with running_server(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls: list[tuple[str, str]], choice: str) -> None:
    assert calls
    for name, arguments in calls:
        if choice == "named":
            assert name == "lookup"
        arguments = json.loads(arguments)
        jsonschema.validate(arguments, SCHEMAS[name])
        assert set(arguments) == set(SCHEMAS[name]["properties"])  # every key required, none added


def streamed(client, **kwargs) -> tuple[list[tuple[str, str]], str | None, str]:
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            slot = calls.setdefault(part.index, ["", ""])
            if part.function is not None:
                slot[0] += part.function.name or ""
                slot[1] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [(name, arguments) for name, arguments in calls.values()], finish, content


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_with_a_forced_tool_choice_answers_a_valid_call(client, choice, stream):
    finished = 0
    for seed in range(4):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                      tool_choice=CHOICES[choice], response_format=RESPONSE_FORMAT, max_tokens=200,
                      temperature=1.0, seed=seed)
        if stream:
            calls, finish, content = streamed(client, **kwargs)
        else:
            chat = client.chat.completions.create(**kwargs)
            message, finish = chat.choices[0].message, chat.choices[0].finish_reason
            calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
            content = message.content or ""
        if finish == "length":
            continue
        assert finish == "tool_calls" and content == ""
        check_calls(calls, choice)
        finished += 1
    assert finished >= 2, "too few forced calls finished inside the budget"


def test_an_explicit_grammar_beside_a_forced_tool_choice_is_still_refused(client):
    response = httpx.post(str(client.base_url) + "chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "required",
        "response_format": RESPONSE_FORMAT, "structured_outputs": {"regex": "a"}, "max_tokens": 4})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "structured_outputs"
