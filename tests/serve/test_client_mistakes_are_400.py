"""Client mistakes in the fields added last (constraints, tools, priority) answer a 400 naming the field.

Each body here used to reach the server's 500 handler: an empty regular language, a JSON schema whose
``$ref`` loops, a grammar that admits no finite string, an oversize choice list, a named tool choice
without its object, a priority no 64-bit integer holds.
"""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import MODEL, running_server

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}


@pytest.fixture(scope="module")
def url():
    engine = Engine(EngineConfig(device="cpu", num_blocks=256, block_size=8, scheduler="priority"),
                    model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1), tokenizer=byte_tokenizer())
    with running_server(engine) as (base, _):
        yield base


def _chat(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **body})


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs"),
    ({"guided_regex": r"[^\s\S]"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CYCLE}}},
     "response_format"),
    ({"structured_outputs": {"json": CYCLE}}, "structured_outputs"),
    ({"guided_grammar": 'start: "a" start'}, "guided_grammar"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(2_001)]}}, "structured_outputs"),
    ({"guided_choice": [f"c{i}" for i in range(2_001)]}, "guided_choice"),
    ({"tools": TOOLS, "tool_choice": {"function": "f"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "nope", "function": {"name": "f"}}}, "tool_choice"),
    ({"priority": -10**4000}, "priority"),
    ({"priority": 2**63}, "priority"),
    ({"priority": -2**63 - 1}, "priority"),
])
def test_a_client_mistake_is_a_400_naming_its_field(url, body, param):
    response = _chat(url, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert len(error["message"].splitlines()) == 1 and "Traceback" not in error["message"], error


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"choice": [f"c{i}" for i in range(2_000)]}},
    {"priority": -2**63}, {"priority": 2**63 - 1},
])
def test_the_edges_of_those_limits_are_served(url, body):
    response = _chat(url, body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "priority": -10**4000}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2, "priority": -10**4000}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_grammar": 'start: "a" start'}),
])
def test_the_other_endpoints_answer_the_same_400(url, path, body):
    response = httpx.post(url + path, json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] in body and error["message"].startswith(error["param"]), error
