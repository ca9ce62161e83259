"""Batch files (``engine run --input``) read the structured-output fields as ``engine serve`` does."""

from __future__ import annotations

import json
import re

from pagedkv.cli.batch_file import run_batch
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}


def line(custom_id: str, url: str, **body) -> str:
    body.setdefault("messages" if url.endswith("chat/completions") else "prompt",
                    [{"role": "user", "content": "x"}] if url.endswith("chat/completions") else "x")
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"max_tokens": 40, "temperature": 1.0, "seed": 1, **body}})


def test_batch_lines_take_every_constraint_spelling_and_refuse_a_bad_one():
    engine = Engine(EngineConfig(device="cpu", num_blocks=256, block_size=8),
                    model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1), tokenizer=byte_tokenizer())
    chat, text = "/v1/chat/completions", "/v1/completions"
    lines = [
        line("schema", chat, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}),
        line("regex", text, structured_outputs={"regex": "[a-z]{3}-[0-9]{2}"}),
        line("choice", chat, guided_choice=["up", "down"]),
        line("bad", chat, guided_json={"type": "nope"}),
        line("two", chat, guided_regex="a", guided_choice=["b"]),
    ]
    written = []
    assert run_batch(engine, lines, written.append, "tiny") == (3, 2)
    by_id = {w["custom_id"]: w for w in written}
    body = lambda cid: by_id[cid]["response"]["body"]  # noqa: E731
    assert json.loads(body("schema")["choices"][0]["message"]["content"])["n"] in range(100)
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", body("regex")["choices"][0]["text"])
    assert body("choice")["choices"][0]["message"]["content"] in ("up", "down")
    assert by_id["bad"]["response"]["status_code"] == 400 and "nope" in by_id["bad"]["error"]["message"]
    assert "cannot be combined" in by_id["two"]["error"]["message"]
    assert engine.pool.num_used == 0


def test_batch_lines_close_schemas_to_unlisted_keys_as_the_server_does():
    engine = Engine(EngineConfig(device="cpu", num_blocks=512, block_size=8),
                    model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1), tokenizer=byte_tokenizer())
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "find", "parameters": city}}]
    lines = [line(f"schema-{seed}", "/v1/chat/completions", seed=seed, max_tokens=60,
                  response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": city}})
             for seed in range(8)]
    lines += [line(f"tool-{seed}", "/v1/chat/completions", seed=seed, max_tokens=60, tools=tools,
                   tool_choice={"type": "function", "function": {"name": "find"}}) for seed in range(8)]
    written = []
    assert run_batch(engine, lines, written.append, "tiny") == (16, 0)
    for w in written:
        choice = w["response"]["body"]["choices"][0]
        message = choice["message"]
        text = message["content"] if w["custom_id"].startswith("schema") else \
            message["tool_calls"][0]["function"]["arguments"]
        assert choice["finish_reason"] in ("stop", "tool_calls") and set(json.loads(text)) == {"city"}, text
