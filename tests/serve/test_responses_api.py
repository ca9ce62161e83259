"""``POST /v1/responses`` through the unmodified OpenAI SDK (``client.responses``) against a live server on the tiny
random model over the byte tokenizer: the grammar, not the model, makes the structured outputs valid."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from serve_helpers import MODEL, running_server

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.serve.api.responses_request import ResponsesRequest
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
          "strict": True}]
NAMED = {"type": "function", "name": "get_weather"}
EVENT_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


class City(BaseModel):
    name: str = Field(max_length=8)
    rank: int = Field(ge=1, le=99)


def engine(thinking: bool = False) -> Engine:
    return Engine(EngineConfig(device="cpu", num_blocks=512, block_size=8),
                  model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1, max_position_embeddings=2048),
                  tokenizer=byte_tokenizer(thinking))


@pytest.fixture(scope="module")
def served():
    with running_server(engine(), tool_call_parser="hermes", enable_auto_tool_choice=True) as (url, server):
        yield url, server


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def test_text_input_answers_a_response_object(client):
    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0.0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.created_at > 0
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert usage.input_tokens > 0 and 1 <= usage.output_tokens <= 6
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if usage.output_tokens == 6:
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_items_with_instructions_render_every_turn(client):
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0.0)
    items = client.responses.create(
        model=MODEL, instructions="Be brief.", max_output_tokens=2, temperature=0.0,
        input=[{"role": "developer", "content": "Answer in French."},
               {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
               {"role": "user", "content": "Again"}])
    # the instructions and each turn reach the template: the prompt grew by at least their characters
    assert items.usage.input_tokens > plain.usage.input_tokens + len("Be brief.Answer in French.SalutAgain")
    assert items.instructions == "Be brief."


def test_a_forced_function_call_and_its_output_round_trip(client):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice=NAMED,
                                    max_output_tokens=80, temperature=1.0, extra_body={"seed": 2})
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = client.responses.create(
        model=MODEL, tools=TOOLS, tool_choice="none", max_output_tokens=4, temperature=0.0,
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
    assert [item.type for item in follow.output] == ["message"]
    assert follow.usage.input_tokens > first.usage.input_tokens + len('{"temp": 21}')  # the history was rendered


def test_streamed_function_call_arguments_match_the_done_event(client):
    with client.responses.stream(model=MODEL, input="x", tools=TOOLS, tool_choice=NAMED, max_output_tokens=80,
                                 temperature=1.0, extra_body={"seed": 4}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = final.output
    # (one delta: a call goes out once it is known complete and valid, so a stream never takes one back)
    assert call.type == "function_call" and deltas == [call.arguments]
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_text_format_json_schema_parses(client):
    parsed = client.responses.parse(model=MODEL, input="A city", text_format=City, max_output_tokens=80,
                                    temperature=1.0, extra_body={"seed": 3})
    assert isinstance(parsed.output_parsed, City)
    raw = client.responses.create(
        model=MODEL, input="A city", max_output_tokens=80, temperature=1.0, extra_body={"seed": 3},
        text={"format": {"type": "json_schema", "name": "city", "schema": City.model_json_schema(), "strict": True}})
    assert [item.type for item in raw.output] == ["message"] and raw.text.format.type == "json_schema"
    City.model_validate_json(raw.output_text)


def test_the_stream_sends_the_events_in_order_and_the_usage_last(client):
    kwargs = dict(model=MODEL, input="Hello", max_output_tokens=5, temperature=0.0)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[-1] in ("response.completed", "response.incomplete")
    deduped = [t for i, t in enumerate(types[:-1]) if i == 0 or t != types[i - 1]]
    assert deduped == EVENT_ORDER
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert done.text == text == final.output_text
    whole = client.responses.create(**kwargs)
    assert final.output_text == whole.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                     whole.usage.output_tokens)
    assert final.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS, "tool_choice": NAMED, "max_output_tokens": 80}])
def test_the_raw_answers_validate_as_the_sdk_types(served, extra):
    """The SDK reads answers leniently; its pydantic types, validated strictly here, catch a missing field."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "temperature": 1.0, "seed": 1, **extra}
    Response.model_validate(httpx.post(served[0] + "/v1/responses", json=body).json())
    with httpx.stream("POST", served[0] + "/v1/responses", json={**body, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = "".join(response.iter_text()).strip().split("\n\n")
    events = TypeAdapter(ResponseStreamEvent)
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert events.validate_python(json.loads(data[len("data: "):])).type == event[len("event: "):]


@pytest.mark.parametrize(("extra", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": 5}, "temperature"),
])
def test_refused_fields_are_named(served, extra, param):
    response = httpx.post(served[0] + "/v1/responses", json={"model": MODEL, "input": "Hi", **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_store_false_and_refusals_through_the_sdk(client):
    ok = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=1)
    assert ok.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError, match="stateless"):
        client.responses.create(model=MODEL, input="Hi", store=True)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")


def test_behind_the_api_key():
    with running_server(engine(), api_key="sekrit") as (url, _):
        response = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "Hi"})
        assert response.status_code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert good.responses.create(model=MODEL, input="Hi", max_output_tokens=1).object == "response"


def test_reasoning_items_from_the_reasoning_parser():
    with running_server(engine(thinking=True), reasoning_parser="deepseek_r1") as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        # the grammar applies after </think> (one token here), which this seed samples after a few tokens
        kwargs = dict(model=MODEL, input="x", max_output_tokens=80, temperature=1.0,
                      extra_body={"seed": 11, "structured_outputs": {"regex": "[a-z]{3,6}"}})
        whole = client.responses.create(**kwargs)
        reasoning, message = whole.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
        assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
        assert message.type == "message" and 3 <= len(whole.output_text) <= 6
        events = list(client.responses.create(stream=True, **kwargs))
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == reasoning.content[0].text
        assert events[-1].response.output_text == whole.output_text


def test_items_become_chat_messages():
    messages = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}],
         "encrypted_content": None},
        {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}", "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "b", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "2"}]},
    ]}).chat_body()["messages"]
    assert messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "b", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"}]


def test_the_chat_request_carries_every_setting():
    chat = ResponsesRequest.model_validate({
        "model": MODEL, "input": "Hi", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stream": True,
        "tools": TOOLS, "tool_choice": NAMED, "text": {"format": {"type": "json_object"}}, "seed": 1}).to_chat()
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed, chat.stream) == (7, 0.5, 0.9, 1, True)
    assert chat.include_usage and chat.response_format == {"type": "json_object"}
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.tools[0]["function"]["parameters"] == WEATHER


def test_auto_tool_choice_gives_a_message_then_a_call_streamed_or_not(client):
    """The grammar makes the random model write text and a hermes call; the items come in that order."""
    hermes = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": '
              r'\{"city": "[a-z]{3,6}", "unit": "(c|f)"\}\}</tool_call>')
    kwargs = dict(model=MODEL, input="x", tools=TOOLS, max_output_tokens=120, temperature=1.0,
                  extra_body={"seed": 5, "structured_outputs": {"regex": hermes}})
    whole = client.responses.create(**kwargs)
    message, call = whole.output
    assert whole.output_text == "Sure. " and message.type == "message"
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(stream=True, **kwargs))
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    done = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert added == done == [(0, "message"), (1, "function_call")]
    final = events[-1].response
    assert final.output_text == "Sure. " and final.output[1].arguments == call.arguments
    assert final.output[1].call_id.startswith("call_")


def test_the_agents_sdk_default_model_runs_a_tool_round_trip(served):
    """The OpenAI Agents SDK's default model speaks the Responses API: each turn sends the earlier function_call and
    function_call_output items back, so three answered turns are three accepted round trips."""
    agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed (pip install openai-agents)")
    import asyncio

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        cities.append(city)
        return "sunny"

    hermes = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,6}"\}\}</tool_call>'

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
        settings = agents.ModelSettings(max_tokens=100, temperature=1.0,
                                        extra_body={"seed": 1, "structured_outputs": {"regex": hermes}})
        agent = agents.Agent(name="a", instructions="Use tools.", tools=[get_weather], model=model,
                             model_settings=settings)
        with pytest.raises(agents.exceptions.MaxTurnsExceeded):
            await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
        plain = agents.Agent(name="b", model=model, model_settings=agents.ModelSettings(
            max_tokens=8, extra_body={"structured_outputs": {"regex": "[a-z]{3}"}}))
        streamed = agents.Runner.run_streamed(plain, "Hi")
        async for _ in streamed.stream_events():
            pass
        await client.close()
        return streamed.final_output

    final = asyncio.run(run())
    assert len(cities) == 3 and all(3 <= len(city) <= 6 for city in cities)
    assert len(final) == 3


def test_a_non_streamed_response_is_respelt_off_the_event_loop(served, monkeypatch):
    # issue 42: the chat answer was json.loads-ed and re-encoded on the event loop; a recorder around the re-spelling
    # says which thread did it (the answer pool's, never the server's loop thread)
    import threading

    from pagedkv.serve import responses_api

    threads: list[str] = []
    original = responses_api.response_from_chat

    def recording(head, answer):
        threads.append(threading.current_thread().name)
        return original(head, answer)

    monkeypatch.setattr(responses_api, "response_from_chat", recording)
    got = httpx.post(served[0] + "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3},
                     timeout=60)
    assert got.status_code == 200 and got.json()["object"] == "response"
    assert got.headers["content-type"].startswith("application/json")
    assert threads and all(name.startswith("pagedkv-answer") for name in threads), threads
