"""A JSON schema that lists properties and leaves ``additionalProperties`` unset (pydantic's, LangChain's) gets no
invented keys: a tiny random model sampled at temperature 1, which adds keys whenever the grammar lets it,
answers exactly the listed keys on every seed, on both endpoints and through every schema field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from serve_helpers import MODEL, running_server

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve.api.structured import structured_from_body
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
NESTED = {"type": "object", "properties": {"place": CITY, "tags": {"type": "array", "items": CITY, "maxItems": 2}},
          "required": ["place", "tags"]}
SEEDS = 12


def engine() -> Engine:
    return Engine(EngineConfig(device="cpu", num_blocks=1024, block_size=8, max_num_seqs=64),
                  model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1, max_position_embeddings=2048),
                  tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def client():
    with running_server(engine()) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def only_listed_keys(value, schema) -> None:
    """Every object in ``value`` has exactly the keys its schema lists."""
    if schema.get("type") == "object":
        assert set(value) == set(schema["properties"]), value
        for key, sub in schema["properties"].items():
            only_listed_keys(value[key], sub)
    elif schema.get("type") == "array":
        for item in value:
            only_listed_keys(item, schema["items"])


def response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}


@pytest.mark.parametrize("schema", [CITY, NESTED], ids=["flat", "nested"])
@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_json"])
def test_no_seed_adds_an_unlisted_key(client, schema, field):
    extra = response_format(schema) if field == "response_format" else {
        field: {"json": schema} if field == "structured_outputs" else schema}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Where?"}], n=SEEDS,
                                          max_tokens=120, temperature=1.0, seed=7, extra_body=extra)
    text = client.completions.create(model=MODEL, prompt="Where?", n=SEEDS, max_tokens=120, temperature=1.0,
                                     seed=8, extra_body=extra)
    answers = [c.message.content for c in chat.choices] + [c.text for c in text.choices]
    assert [c.finish_reason for c in (*chat.choices, *text.choices)] == ["stop"] * 2 * SEEDS
    for answer in answers:
        value = json.loads(answer)
        jsonschema.validate(value, schema)
        only_listed_keys(value, schema)


def test_a_schema_that_sets_additional_properties_is_left_as_is(client):
    typed = {**CITY, "additionalProperties": {"type": "integer"}}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Where?"}], n=SEEDS,
                                          max_tokens=120, temperature=1.0, seed=7, extra_body=response_format(typed))
    finished = [json.loads(c.message.content) for c in chat.choices if c.finish_reason == "stop"]
    for value in finished:
        jsonschema.validate(value, typed)
    assert any(len(value) > 1 for value in finished), "the extra keys the schema allows never came"
    open_ = {**CITY, "additionalProperties": True}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Where?"}], n=SEEDS,
                                          max_tokens=60, temperature=1.0, seed=7, extra_body=response_format(open_))
    assert any(c.finish_reason == "length" or len(json.loads(c.message.content)) > 1 for c in chat.choices)


def generate(constraint, seeds: int = SEEDS) -> list[tuple[str, str]]:
    core = engine()
    ids = [core.add_request("Where?", SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured=constraint))
           for s in range(seeds)]
    outputs = {}
    while core.has_unfinished():
        for out in core.step(stream=False):
            outputs[out.request_id] = out
    return [(outputs[i].outputs[0].text, outputs[i].outputs[0].finish_reason) for i in ids]


def test_allowing_additional_properties_gives_the_open_schema_back():
    """What the server's allow option compiles: the schema as given, so the same seeds invent keys."""
    body = response_format(CITY)
    closed, _ = structured_from_body(body)
    allowed, _ = structured_from_body(body, allow_additional_properties=True)
    assert allowed.json == CITY and closed.json == {**CITY, "additionalProperties": False}
    assert all(finish == "stop" and set(json.loads(text)) == {"city"} for text, finish in generate(closed))
    opened = generate(allowed)
    assert any(finish == "length" or len(json.loads(text)) > 1 for text, finish in opened), opened


def test_an_all_of_intersection_holds_every_member_key_and_no_other():
    a = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"enum": [3, 4]}}, "required": ["b"]}
    constraint, _ = structured_from_body({"guided_json": {"allOf": [a, b]}})
    for text, finish in generate(constraint):
        assert finish == "stop" and set(json.loads(text)) == {"a", "b"}, text


def test_the_server_option_allows_unlisted_keys_again():
    with running_server(engine(), allow_additional_properties=True) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Where?"}],
                                              n=SEEDS, max_tokens=60, temperature=1.0, seed=7,
                                              extra_body=response_format(CITY))
    assert any(c.finish_reason == "length" or len(json.loads(c.message.content)) > 1 for c in chat.choices)
