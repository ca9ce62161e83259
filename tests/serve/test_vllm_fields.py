"""Every field of vLLM's chat and completions requests is implemented with vLLM's meaning or refused by name.

The field lists below are vLLM's own, written down from vLLM's request models: the OpenAI fields and
vLLM's sampling / extra parameters of ``ChatCompletionRequest`` and ``CompletionRequest`` in
``vllm/entrypoints/openai/protocol.py`` (vllm-project/vllm at commit 0052bed3, the v0.10 line, which
still has the ``guided_*`` fields), plus those the current docs list for the v0.11+ line
(docs.vllm.ai "OpenAI-Compatible Server": ``structured_outputs``, ``return_token_ids``,
``repetition_detection``, ``media_io_kwargs``, ``prompt_embeds``). Each sample value below differs
from vLLM's default; a field pagedkv implements answers 200 with it, one it refuses answers 400 naming
it. Nothing is silently ignored.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import running_server, tiny_chat_engine

from pagedkv.serve.api.chat import ChatCompletionRequest
from pagedkv.serve.api.completion import CompletionRequest
from pagedkv.serve.testing import byte_level_tokenizer

VLLM_VERSION = "vllm-project/vllm 0052bed3 (v0.10 line) + docs.vllm.ai latest (v0.11 fields)"

# field -> (a non-default sample value, "ok" if pagedkv implements it, "refused" if it answers 400 naming it
#          [, fields it needs beside it])
COMMON = {
    "model": ("tiny", "ok"), "frequency_penalty": (0.5, "ok"), "presence_penalty": (0.5, "ok"),
    "logit_bias": ({"5": 1.0}, "ok"), "n": (2, "ok"), "seed": (7, "ok"), "stop": (["zzz"], "ok"),
    "stream": (False, "ok"), "temperature": (0.5, "ok"), "top_p": (0.9, "ok"), "user": ("u1", "ok"),
    "best_of": (None, "ok"), "use_beam_search": (True, "refused"), "top_k": (5, "ok"), "min_p": (0.1, "ok"),
    "repetition_penalty": (1.1, "ok"), "length_penalty": (0.5, "refused"), "stop_token_ids": ([9], "ok"),
    "include_stop_str_in_output": (True, "ok"), "ignore_eos": (True, "ok"), "min_tokens": (1, "ok"),
    "skip_special_tokens": (False, "ok"), "spaces_between_special_tokens": (False, "ok"),
    "truncate_prompt_tokens": (4, "ok"), "prompt_logprobs": (1, "ok"), "allowed_token_ids": ([5, 6, 7], "ok"),
    "bad_words": (["zebra"], "ok"), "add_special_tokens": (True, "ok"), "response_format": ({"type": "text"}, "ok"),
    "priority": (0, "ok"), "request_id": ("my-request", "ok"), "cache_salt": ("salt", "ok"),
    "return_token_ids": (True, "ok"),
    "structured_outputs": ({"choice": ["yes", "no"]}, "ok"),
    "guided_json": ({"type": "object"}, "ok"), "guided_regex": ("a+", "ok"),
    "guided_choice": (["yes", "no"], "ok"), "guided_grammar": ("root ::= 'a'", "refused"),
    "guided_decoding_backend": ("xgrammar", "refused"), "guided_whitespace_pattern": (" ", "refused"),
    "structural_tag": ("{}", "refused"), "logits_processors": (["x.y"], "refused"),
    "return_tokens_as_token_ids": (True, "refused"), "kv_transfer_params": ({"a": 1}, "refused"),
    "vllm_xargs": ({"a": 1}, "refused"), "repetition_detection": ({"max_pattern_size": 4}, "refused"),
    "mm_processor_kwargs": ({"a": 1}, "refused"), "media_io_kwargs": ({"image": {}}, "refused"),
}
CHAT = {
    **COMMON, "logprobs": (True, "ok"), "top_logprobs": (2, "ok", {"logprobs": True}), "max_tokens": (4, "ok"),
    "max_completion_tokens": (4, "ok"), "stream_options": (None, "ok"), "tools": (None, "ok"),
    "tool_choice": ("none", "ok"), "reasoning_effort": ("low", "refused"), "include_reasoning": (False, "ok"),
    "parallel_tool_calls": (True, "ok"), "echo": (True, "ok"), "add_generation_prompt": (False, "ok"),
    "continue_final_message": (False, "ok"), "add_special_tokens": (True, "ok"), "documents": ([], "ok"),
    "chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "ok"),
    "chat_template_kwargs": ({"x": 1}, "ok"),
}
COMPLETION = {
    **COMMON, "echo": (True, "ok"), "logprobs": (2, "ok"), "max_tokens": (4, "ok"), "suffix": ("end", "refused"),
    "stream_options": (None, "ok"), "prompt_embeds": ("AAAA", "refused"),
}


@pytest.fixture(scope="module")
def server():
    tokenizer = byte_level_tokenizer()
    engine = tiny_chat_engine(tokenizer, enable_prefix_caching=True)
    # chat_template is a vLLM field that answers only on a server trusting request templates (as vLLM)
    with running_server(engine, served_model_names=["tiny", "tiny-alias"],
                        trust_request_chat_template=True) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client, tokenizer


def _chat(**fields):
    return {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 4, "temperature": 0} | fields


def _completion(**fields):
    return {"prompt": "Hello world, how are you", "max_tokens": 4, "temperature": 0} | fields


def test_every_vllm_field_is_declared_so_none_is_silently_dropped():
    assert VLLM_VERSION
    assert set(CHAT) - set(ChatCompletionRequest.model_fields) == set()
    assert set(COMPLETION) - set(CompletionRequest.model_fields) == set()


@pytest.mark.parametrize(("route", "fields", "name"),
                         [("/v1/chat/completions", CHAT, n) for n in CHAT]
                         + [("/v1/completions", COMPLETION, n) for n in COMPLETION])
def test_each_vllm_field_is_handled_or_refused_by_name(server, route, fields, name):
    client, _ = server
    value, verdict, *also = fields[name]
    body = (_chat if route.endswith("chat/completions") else _completion)(**{name: value}, **(also[0] if also else {}))
    response = client.post(route, json=body)
    if verdict == "ok":
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == name


def _greedy(client, **fields):
    body = _completion(**({"max_tokens": 8, "ignore_eos": True, "return_token_ids": True} | fields))
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_stop_token_ids_end_the_answer_there_and_their_text_is_left_out(server):
    client, tokenizer = server
    plain = _greedy(client)["choices"][0]
    stop = plain["token_ids"][3]
    first = plain["token_ids"].index(stop)
    cut = _greedy(client, stop_token_ids=[stop])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["token_ids"] == plain["token_ids"][: first + 1]
    assert cut["text"] == tokenizer.decode(plain["token_ids"][:first])  # the stop token's text is not answered
    kept = _greedy(client, stop_token_ids=[stop], include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == tokenizer.decode(plain["token_ids"][: first + 1])


def test_include_stop_str_in_output_keeps_the_stop_string(server):
    client, _ = server
    text = _greedy(client)["choices"][0]["text"]
    stop = text[2:4]
    assert _greedy(client, stop=[stop])["choices"][0]["text"] == text[: text.index(stop)]
    assert _greedy(client, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"] == \
        text[: text.index(stop) + len(stop)]


def test_allowed_token_ids_and_skip_special_tokens(server):
    client, tokenizer = server
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    choice = _greedy(client, allowed_token_ids=[start], max_tokens=2)["choices"][0]
    assert choice["token_ids"] == [start, start] and choice["text"] == ""
    shown = _greedy(client, allowed_token_ids=[start], max_tokens=2, skip_special_tokens=False)["choices"][0]
    assert shown["text"] == "<|im_start|><|im_start|>"
    allowed = [40, 41, 42]
    assert set(_greedy(client, allowed_token_ids=allowed)["choices"][0]["token_ids"]) <= set(allowed)


def test_bad_words_are_never_generated(server):
    client, tokenizer = server
    the = tokenizer("The", add_special_tokens=False)["input_ids"]
    assert len(the) == 1, "the fixture's 'The' must be one token"
    other = 40
    ids = _greedy(client, allowed_token_ids=[the[0], other], bad_words=["The"])["choices"][0]["token_ids"]
    assert ids == [other] * 8  # a one-token bad word is banned at every step
    hello = tokenizer("Hello", add_special_tokens=False)["input_ids"]
    assert len(hello) == 2, "the fixture's 'Hello' must be two tokens"
    ids = _greedy(client, allowed_token_ids=hello, bad_words=["Hello"], max_tokens=12)["choices"][0]["token_ids"]
    assert hello[0] in ids and all(ids[i:i + 2] != hello for i in range(len(ids) - 1))  # never completed


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    client, _ = server
    full = _greedy(client)["choices"][0]["prompt_token_ids"]
    body = _greedy(client, truncate_prompt_tokens=3)
    assert body["usage"]["prompt_tokens"] == 3 and body["choices"][0]["prompt_token_ids"] == full[-3:]


def test_echo_and_return_token_ids_on_completions(server):
    client, tokenizer = server
    body = _greedy(client, echo=True)
    choice = body["choices"][0]
    assert choice["text"].startswith("Hello world, how are you")
    assert choice["prompt_token_ids"] == list(tokenizer("Hello world, how are you")["input_ids"])
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 8


def test_max_tokens_null_on_completions_is_16(server):
    client, _ = server
    body = client.post("/v1/completions", json=_completion(max_tokens=None, ignore_eos=True)).json()
    assert body["usage"]["completion_tokens"] == 16


def test_cache_salt_keeps_prefix_cache_entries_apart_and_cached_tokens_are_reported(server):
    client, _ = server
    prompt = "The quick brown fox jumps over the lazy dog. " * 3

    def cached(**fields):
        body = client.post("/v1/completions", json=_completion(prompt=prompt, max_tokens=1, **fields)).json()
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0


def test_priority_is_refused_without_the_priority_policy(server):
    client, _ = server
    response = client.post("/v1/completions", json=_completion(priority=1))
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    client, _ = server
    body = _completion(max_tokens=5, ignore_eos=True, stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert all(e["usage"] is not None for e in events) and counts == sorted(counts) and counts[-1] == 5


def test_chat_template_fields_and_tool_history_reach_the_template(server):
    client, tokenizer = server
    template = ("{{ greeting }}|{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
                "{% if m.tool_calls %}[{{ m.tool_calls[0].function.arguments.city }}]{% endif %}"
                "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %};{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call1"},
    ]
    body = {"messages": messages, "chat_template": template, "chat_template_kwargs": {"greeting": "hey"}}
    ids = client.post("/tokenize", json=body).json()["tokens"]
    assert tokenizer.decode(ids) == "hey|user:weather?;assistant:[Paris];tool:sunny(call1);assistant:"
    ids = client.post("/tokenize", json={**body, "add_generation_prompt": False}).json()["tokens"]
    assert tokenizer.decode(ids).endswith("(call1);")
    chat = client.post("/v1/chat/completions", json=_chat(messages=messages, chat_template=template,
                                                          chat_template_kwargs={"greeting": "hey"},
                                                          return_token_ids=True)).json()
    assert chat["prompt_token_ids"] == client.post("/tokenize", json=body).json()["tokens"]


def test_continue_final_message_leaves_the_last_message_open(server):
    client, tokenizer = server
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The capital"}]
    ids = client.post("/tokenize", json={"messages": messages, "continue_final_message": True,
                                          "add_generation_prompt": False}).json()["tokens"]
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\nThe capital")
    both = client.post("/v1/chat/completions", json=_chat(messages=messages, continue_final_message=True,
                                                          add_generation_prompt=True))
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    echoed = client.post("/v1/chat/completions", json=_chat(messages=messages, continue_final_message=True,
                                                            echo=True)).json()
    assert echoed["choices"][0]["message"]["content"].startswith("The capital")


def test_tokenize_detokenize_version_and_model_routes(server):
    client, tokenizer = server
    tokens = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == list(tokenizer("Hello world")["input_ids"]) and tokens["count"] == len(tokens["tokens"])
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    assert client.get("/version").json()["version"]
    assert client.get("/v1/models/tiny-alias").json()["id"] == "tiny-alias"
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "tiny-alias"]
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    answer = client.post("/v1/completions", json=_completion(model="tiny-alias")).json()
    assert answer["model"] == "tiny"  # every served name is accepted; responses carry the first (vLLM)


def test_server_limits_priority_policy_and_vllm_metric_names():
    tokenizer = byte_level_tokenizer()
    engine = tiny_chat_engine(tokenizer, scheduler="priority")
    with running_server(engine, max_logprobs=2, metrics_prefix="vllm") as (url, _):
        with httpx.Client(base_url=url, timeout=120) as client:
            too_many = client.post("/v1/completions", json=_completion(logprobs=3))
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
            assert client.post("/v1/completions", json=_completion(logprobs=2, priority=-5)).status_code == 200
            metrics = client.get("/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines() if line and not line.startswith("#")}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
                 "vllm:num_preemptions_total"):
        assert name in names, name
    assert not any(name.endswith("_created") for name in names) and not any("pagedkv:" in n for n in names)
    assert 'vllm:request_queue_time_seconds_count{model_name="tiny"} 1.0' in metrics


def test_generation_config_defaults_fill_only_unset_fields():
    from transformers import GenerationConfig

    from pagedkv.serve.generation_defaults import sampling_defaults

    class Model:
        generation_config = GenerationConfig(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=99)

    defaults = sampling_defaults("auto", Model())
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 99}
    assert sampling_defaults("vllm", Model()) == {}
    unset = CompletionRequest(prompt="x").to_sampling_params(16, None, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 20)
    given = CompletionRequest(prompt="x", temperature=0.0, top_k=-1).to_sampling_params(16, None, defaults)
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.9, 0)
    plain = CompletionRequest(prompt="x").to_sampling_params(16, None, {})
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty) == (1.0, 1.0, 0, 1.0)
