"""engine serve and engine run --input read a body by the same rules: each body is refused by both or by neither."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import running_server, tiny_chat_engine

from pagedkv.cli.batch_file import BatchLineError, parse_line
from pagedkv.serve.testing import byte_level_tokenizer

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
CASES = [  # (url, body, accepted)
    (TEXT, {"prompt": "x", "max_tokens": 2}, True),
    (TEXT, {"prompt": "x", "max_tokens": None, "temperature": None, "seed": None}, True),
    (TEXT, {"prompt": [3, 4], "max_tokens": 2, "stop": ["a", "b"], "temperature": 0}, True),
    (TEXT, {"prompt": "x", "max_tokens": "5"}, False),
    (TEXT, {"prompt": "x", "max_tokens": True}, False),
    (TEXT, {"prompt": "x", "max_tokens": 5.0}, False),
    (TEXT, {"prompt": "x", "temperature": "0"}, False),
    (TEXT, {"prompt": "x", "n": "2"}, False),
    (TEXT, {"prompt": "x", "stream": "yes"}, False),
    (TEXT, {"prompt": [True, False]}, False),
    (TEXT, {"prompt": "x", "logprobs": True}, False),
    (TEXT, {"prompt": "x", "max_token": 8}, False),
    (TEXT, {"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, False),
    (TEXT, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, False),
    (TEXT, {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, False),
    (TEXT, {"prompt": "x \ud800"}, False),
    (CHAT, {"messages": USER, "max_tokens": 2}, True),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}, True),
    (CHAT, {"messages": [{"role": "assistant", "content": None}, *USER], "max_tokens": 2}, True),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, False),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, False),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "mood": "sunny"}]}, False),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, False),
    (CHAT, {"messages": USER, "logprobs": 3}, False),
    (CHAT, {"messages": [{"role": "user", "content": "\udfff"}]}, False),
    (CHAT, {"messages": USER * 1025}, False),
]


@pytest.fixture(scope="module")
def setup():
    tokenizer = byte_level_tokenizer()
    engine = tiny_chat_engine(tokenizer)
    with running_server(engine) as (url, _):
        yield url, engine


@pytest.mark.parametrize(("url", "body", "accepted"), CASES)
def test_the_server_and_a_batch_file_agree(setup, url, body, accepted):
    base, engine = setup
    raw = json.dumps(body, ensure_ascii=True)  # a lone surrogate travels as its \\u escape
    response = httpx.post(base + url, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    line = json.dumps({"custom_id": "c", "url": url, "body": body}, ensure_ascii=True)
    try:
        parse_line(line, engine.tokenizer, 16, engine.vocab_size)
        batch_ok = True
    except BatchLineError:
        batch_ok = False
    assert (response.status_code == 200, batch_ok) == (accepted, accepted), response.text
    if not accepted:
        assert response.status_code == 400 and response.json()["error"]["message"]


def test_a_chat_template_that_raises_is_a_400_naming_messages():
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('no system messages here') }}{% endif %}{{ m['content'] }}"
                               "{% endfor %}")
    with running_server(tiny_chat_engine(tokenizer)) as (url, _):
        response = httpx.post(url + CHAT, json={"messages": [{"role": "system", "content": "x"}, *USER]}, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and "no system messages here" in error["message"]
        assert httpx.post(url + CHAT, json={"messages": USER, "max_tokens": 2}, timeout=60).status_code == 200
