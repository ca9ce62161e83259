"""pydantic-ai's ``Agent`` with an ``output_type``, unmodified, against a live ``engine serve``: its default tool
output (a ``final_result`` tool the request requires) and its native output (``response_format`` json_schema), over
the OpenAI chat model. Structure and protocol, not the tiny model's wisdom."""

from __future__ import annotations

import json

import pytest
from client_server import COMMA_BIAS, Trip, tool_server
from serve_helpers import MODEL

pytest.importorskip("pydantic_ai",
                    reason="pydantic-ai is not installed (pip install -e '.[clients]', which make setup does)")


@pytest.fixture(scope="module")
def url():
    with tool_server() as base:
        yield base


def agent(url: str, output_type, sent: list[dict], logit_bias: dict | None = COMMA_BIAS):
    """An agent whose HTTP client keeps each request body it sends in ``sent``."""
    import httpx2
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def keep(request: httpx2.Request) -> None:
        sent.append(json.loads(request.content))

    http = httpx2.AsyncClient(event_hooks={"request": [keep]}, timeout=120)
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url + "/v1", api_key="unused", http_client=http))
    return Agent(model, output_type=output_type, retries=0,
                 model_settings={"max_tokens": 120, "temperature": 0.0, "logit_bias": logit_bias or {}})


def test_the_default_tool_output_returns_the_model(url):
    sent: list[dict] = []
    # no comma bias here: in a required call list a comma starts another call, and a list cut off at max_tokens
    # is content (only complete, valid calls are calls)
    result = agent(url, Trip, sent, logit_bias=None).run_sync("Plan a trip.")
    assert isinstance(result.output, Trip)
    [body] = sent  # the tool the answer must call, required: the forced choice sets the grammar
    assert body["tool_choice"] == "required" and [t["function"]["name"] for t in body["tools"]] == ["final_result"]
    calls = [part.tool_name for message in result.all_messages() for part in message.parts
             if part.part_kind == "tool-call"]
    assert calls and set(calls) == {"final_result"}  # required allows several calls; pydantic-ai takes the first
    assert result.usage.input_tokens > 0 and result.usage.output_tokens > 0


def test_native_output_returns_the_model(url):
    from pydantic_ai import NativeOutput

    sent: list[dict] = []
    result = agent(url, NativeOutput(Trip), sent).run_sync("Plan a trip.")
    assert isinstance(result.output, Trip)
    [body] = sent
    assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    assert not [part for message in result.all_messages() for part in message.parts if part.part_kind == "tool-call"]
