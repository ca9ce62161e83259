"""The docs' structured-output and tool-calling examples against ``engine serve`` on the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel
from serve_helpers import MODEL, running_server

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}]


class City(BaseModel):
    name: str
    population: int


@pytest.fixture(scope="module")
def client(smollm2):
    model, tokenizer = smollm2
    engine = Engine(EngineConfig(device="cpu", num_blocks=512), model=model, tokenizer=tokenizer)
    with running_server(engine, tool_call_parser="hermes", enable_auto_tool_choice=True) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_parse_a_pydantic_model_and_a_choice(client):
    completion = client.beta.chat.completions.parse(
        model=MODEL, response_format=City, max_tokens=100, temperature=0,
        messages=[{"role": "user", "content": "Give me a French city and its population as JSON."}])
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(completion.choices[0].message.parsed, City)
    colour = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0, messages=[{"role": "user", "content": "Is the sky blue or green?"}],
        extra_body={"structured_outputs": {"choice": ["blue", "green"]}})
    assert colour.choices[0].message.content in ("blue", "green")


def test_required_tool_call_a_tool_turn_and_a_streamed_call(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    streamed = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages[:1], tools=TOOLS,
                                                tool_choice="required", max_tokens=60, temperature=0, stream=True):
        for part in chunk.choices[0].delta.tool_calls or ():
            slot = streamed.setdefault(part.index, {"name": part.function.name, "arguments": ""})
            slot["arguments"] += part.function.arguments or ""
    assert [(s["name"], s["arguments"]) for s in streamed.values()] == [("get_weather", call.function.arguments)]
