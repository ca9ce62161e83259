"""engine serve and engine run --input parse a body through the same models: refused by both or by neither,
and a field means the same in a batch line as in a request."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import MODEL, running_server, tiny_chat_engine

from pagedkv.cli.batch_file import run_batch
from pagedkv.serve.testing import byte_level_tokenizer

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
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
    # vLLM's fields (issue 26): accepted with vLLM's meaning, or refused by name, by both front ends
    (TEXT, {"prompt": "x", "max_tokens": 2, "stop_token_ids": [5], "include_stop_str_in_output": True,
            "skip_special_tokens": False, "spaces_between_special_tokens": False, "bad_words": ["zz"],
            "allowed_token_ids": [3, 4, 5, 6], "truncate_prompt_tokens": 1, "cache_salt": "s", "priority": 0,
            "return_token_ids": True, "request_id": "r1", "best_of": 1, "echo": True, "add_special_tokens": False,
            "use_beam_search": False, "length_penalty": 1.0, "min_tokens": 1}, True),
    (TEXT, {"prompt": "x", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}, True),
    (TEXT, {"prompt": "x", "stop_token_ids": ["a"]}, False),
    (TEXT, {"prompt": "x", "include_stop_str_in_output": "yes"}, False),
    (TEXT, {"prompt": "x", "bad_words": "zz"}, False),
    (TEXT, {"prompt": "x", "truncate_prompt_tokens": 0}, False),
    (TEXT, {"prompt": "x", "truncate_prompt_tokens": -2}, False),
    (TEXT, {"prompt": "x", "use_beam_search": True}, False),
    (TEXT, {"prompt": "x", "best_of": 2}, False),
    (TEXT, {"prompt": "x", "length_penalty": 0.5}, False),
    (TEXT, {"prompt": "x", "cache_salt": ""}, False),
    (TEXT, {"prompt": "x", "allowed_token_ids": []}, False),
    (TEXT, {"prompt": "x", "logits_processors": ["f"]}, False),
    (TEXT, {"prompt": "x", "kv_transfer_params": {"a": 1}}, False),
    (TEXT, {"prompt": "x", "prompt_embeds": "AAAA"}, False),
    (TEXT, {"prompt": "x", "priority": 1}, False),  # this server schedules first come, first served
    (TEXT, {"prompt": "x", "max_tokens": 0}, False),
    (TEXT, {"prompt": "x", "suffix": "s"}, False),
    (TEXT, {"prompt": "x", "top_logprobs": 2}, False),  # a chat field
    (TEXT, {"prompt": "x", "stream_options": {"include_usage": True}}, False),
    (TEXT, {"prompt": ""}, False),
    (CHAT, {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False},
            "add_generation_prompt": True, "documents": [{"title": "a", "text": "b"}], "include_reasoning": True,
            "skip_special_tokens": True, "return_token_ids": True, "parallel_tool_calls": False}, True),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": "Hel"}], "continue_final_message": True,
            "add_generation_prompt": False, "echo": True, "max_completion_tokens": 2}, True),
    (CHAT, {"messages": USER, "max_tokens": 2, "tools": [TOOL], "tool_choice": "none"}, True),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"tools": []}}, False),
    (CHAT, {"messages": USER, "continue_final_message": True, "add_generation_prompt": True}, False),
    (CHAT, {"messages": USER, "tools": [TOOL]}, False),  # "auto" needs --tool-call-parser
    (CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "no"}}},
     False),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}], "tool_choice": "none"}, False),
    (CHAT, {"messages": USER, "reasoning_effort": "low"}, False),
    (CHAT, {"messages": USER, "echo": 1}, False),
    (CHAT, {"messages": USER, "documents": [{"title": 1}]}, False),
    (CHAT, {"messages": USER, "chat_template_kwargs": "x"}, False),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "tool_call_id": 5}]}, False),
    (CHAT, {"messages": USER, "prompt": "x"}, False),  # a completions field
]


@pytest.fixture(scope="module")
def setup():
    tokenizer = byte_level_tokenizer()
    engine = tiny_chat_engine(tokenizer)
    with running_server(engine) as (url, _):
        yield url, tiny_chat_engine(tokenizer)  # the same weights, for the batch runs (the server's steps on a thread)


def _batch(engine, url: str, body: dict) -> dict:
    line = json.dumps({"custom_id": "c", "url": url, "body": body}, ensure_ascii=True)
    written: list[dict] = []
    run_batch(engine, [line], written.append, MODEL, default_max_tokens=16)
    assert len(written) == 1 and not engine.has_unfinished()
    return written[0]


@pytest.mark.parametrize(("url", "body", "accepted"), CASES)
def test_the_server_and_a_batch_file_agree(setup, url, body, accepted):
    base, engine = setup
    raw = json.dumps(body, ensure_ascii=True)  # a lone surrogate travels as its \\u escape
    response = httpx.post(base + url, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    result = _batch(engine, url, body)
    assert (response.status_code == 200, result["error"] is None) == (accepted, accepted), (response.text, result)
    if not accepted:
        assert response.status_code == 400 and response.json()["error"]["message"]
    assert engine.pool.num_free == engine.num_blocks


@pytest.mark.parametrize("body", [{"prompt": "x", "echo": True, "logprobs": 1},
                                  {"prompt": "x", "echo": True, "max_tokens": 0}])
def test_echo_of_the_prompts_logprobs_is_served_and_answered_in_a_batch_file(setup, body):
    # batch lines parse with the server's completion model, so echo with logprobs answers there too
    base, engine = setup
    assert httpx.post(base + TEXT, json=body, timeout=60).status_code == 200
    result = _batch(engine, TEXT, body)
    assert result["error"] is None and result["response"]["status_code"] == 200, result
    assert engine.pool.num_free == engine.num_blocks


MEANING = [  # greedy bodies whose answers must match field for field
    (TEXT, {"prompt": "ab", "max_tokens": 6, "temperature": 0, "echo": True, "return_token_ids": True,
            "ignore_eos": True, "bad_words": ["zz"], "allowed_token_ids": list(range(60, 90))}),
    (TEXT, {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "truncate_prompt_tokens": 2,
            "return_token_ids": True, "ignore_eos": True}),
    (CHAT, {"messages": [*USER, {"role": "assistant", "content": "Hel"}], "continue_final_message": True,
            "add_generation_prompt": False, "echo": True, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "tools": [TOOL], "tool_choice": "none"}),
]


@pytest.mark.parametrize(("url", "body"), MEANING)
def test_a_field_means_the_same_in_a_batch_line(setup, url, body):
    base, engine = setup
    served = httpx.post(base + url, json=body, timeout=60)
    assert served.status_code == 200, served.text
    batched = _batch(engine, url, body)["response"]["body"]
    keys = ("text", "message", "token_ids", "prompt_token_ids", "finish_reason")
    pick = [{k: choice.get(k) for k in keys} for choice in served.json()["choices"]]
    assert [{k: choice.get(k) for k in keys} for choice in batched["choices"]] == pick
    assert batched.get("prompt_token_ids") == served.json().get("prompt_token_ids")


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
