"""LangChain's ``ChatOpenAI`` (langchain-openai), unmodified, against a live ``engine serve``: invoke, stream,
``with_structured_output`` by json_schema (strict and not) and by function calling, and a named tool round trip
(the assistant's tool call and the tool's answer sent back). Structure and protocol, not the tiny model's wisdom."""

from __future__ import annotations

from typing import Literal

import pytest
from client_server import COMMA_BIAS, TRIP_KEYS, Trip, tool_server
from pydantic import BaseModel, Field
from serve_helpers import MODEL

pytest.importorskip("langchain_openai",
                    reason="langchain-openai is not installed (pip install -e '.[clients]', which make setup does)")


class Weather(BaseModel):
    """Weather in a city."""

    city: str = Field(max_length=8)
    unit: Literal["c", "f"]


@pytest.fixture(scope="module")
def url():
    with tool_server() as base:
        yield base


def chat(url: str, **options):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", max_retries=0,
                      **{"max_tokens": 120, "temperature": 0, **options})


def test_invoke_and_stream_give_the_same_text_and_usage(url):
    llm = chat(url, max_tokens=6, stream_usage=True)
    answer = llm.invoke("Hello")
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("length", "stop")
    usage = answer.usage_metadata
    assert usage["input_tokens"] > 0 and 1 <= usage["output_tokens"] <= 6
    chunks = list(llm.stream("Hello"))
    assert len(chunks) > 1
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    assert whole.content == answer.content
    assert whole.usage_metadata["output_tokens"] == usage["output_tokens"]
    assert whole.usage_metadata["input_tokens"] == usage["input_tokens"]


@pytest.mark.parametrize("method,strict", [("json_schema", None), ("json_schema", True),
                                           ("function_calling", None), ("function_calling", True)])
def test_with_structured_output_returns_the_model(url, method, strict):
    llm = chat(url, logit_bias={int(k): v for k, v in COMMA_BIAS.items()})
    structured = llm.with_structured_output(Trip, method=method, strict=strict, include_raw=True)
    result = structured.invoke("Plan a trip.")
    assert result["parsing_error"] is None, result["raw"]
    assert isinstance(result["parsed"], Trip)
    if method == "function_calling":
        [call] = result["raw"].tool_calls
        assert call["name"] == "Trip" and set(call["args"]) == TRIP_KEYS


def test_a_named_tool_round_trip(url):
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat(url)
    bound = llm.bind_tools([Weather], tool_choice="Weather")
    question = HumanMessage("Weather in Paris?")
    asked = bound.invoke([question])
    [call] = asked.tool_calls
    assert call["name"] == "Weather" and call["id"]
    Weather.model_validate(call["args"])  # exactly the schema's keys (extra keys are allowed by nothing here)
    assert set(call["args"]) == {"city", "unit"}
    streamed = list(bound.stream([question]))
    whole = streamed[0]
    for chunk in streamed[1:]:
        whole = whole + chunk
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [(call["name"], call["args"])]
    answer = llm.invoke([question, asked, ToolMessage("sunny, 21 c", tool_call_id=call["id"])], max_tokens=8)
    assert isinstance(answer.content, str) and not answer.tool_calls
    # the call and the tool's answer reached the template (one token a byte): the prompt grew by at least their text
    alone = llm.invoke([question], max_tokens=1).usage_metadata["input_tokens"]
    assert answer.usage_metadata["input_tokens"] >= alone + len("sunny, 21 c" + call["args"]["city"])
