"""The OpenAI Agents SDK, unmodified, against a live ``engine serve``, over both of its OpenAI models (chat
completions and the Responses API): an agent with a required tool and an ``output_type`` (the SDK then sends the
output's schema beside the required tool choice, the issue's case 2) calls the tool, gets its answer back, and
ends with the typed output. Structure and protocol, not the tiny model's wisdom."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import pytest
from client_server import City, tool_server
from pydantic import Field
from serve_helpers import MODEL

pytest.importorskip("agents", reason="the OpenAI Agents SDK is not installed (pip install -e '.[clients]', which "
                                     "make setup does)")


@pytest.fixture(scope="module")
def url():
    with tool_server() as base:
        yield base


async def run_agent(url: str, model_class: str, sent: list[dict]):
    import agents
    import httpx2
    import openai

    async def keep(request: httpx2.Request) -> None:
        sent.append(json.loads(request.content))

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """Weather in a city (the bound ends a constrained call well inside max_tokens)."""
        cities.append(city)
        return "sunny"

    http = httpx2.AsyncClient(event_hooks={"request": [keep]}, timeout=120)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
    model = getattr(agents, model_class)(model=MODEL, openai_client=client)
    # the SDK resets tool_choice to auto after a tool ran (reset_tool_choice), so the second turn may answer
    settings = agents.ModelSettings(tool_choice="required", max_tokens=120, temperature=0.0)
    agent = agents.Agent(name="a", instructions="Use tools.", tools=[get_weather], model=model,
                         model_settings=settings, output_type=City)
    result = await agents.Runner.run(agent, "Weather in Paris?", max_turns=3)
    await client.close()
    return result, cities


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_a_required_tool_round_trip_ends_with_the_output_type(url, model_class):
    sent: list[dict] = []
    result, cities = asyncio.run(run_agent(url, model_class, sent))
    assert isinstance(result.final_output, City)
    assert len(cities) == 1 and isinstance(cities[0], str)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    first, second = sent
    assert first["tool_choice"] == "required"
    if model_class == "OpenAIChatCompletionsModel":
        assert first["response_format"]["type"] == "json_schema"
        assert [m["role"] for m in second["messages"]][-2:] == ["assistant", "tool"]
    else:
        assert first["text"]["format"]["type"] == "json_schema"
        assert [item.get("type") for item in second["input"]][-2:] == ["function_call", "function_call_output"]
