"""engine serve, driven over real HTTP with the official openai client (sync and async)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL, running_server, tiny_chat_engine

from conftest import hf_greedy
from pagedkv.core.hookspecs import hookimpl
from pagedkv.serve.testing import byte_level_tokenizer

FAIL_TOKEN = 5  # a completion prompt starting with this token fails inside the step (a plugin fault)
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


class FailMarkedPrompts:
    @hookimpl
    def pagedkv_match_prefix(self, seq, allocator):
        if seq.prompt_token_ids[0] == FAIL_TOKEN:
            raise ValueError("marked to fail")
        return None


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer):
    engine = tiny_chat_engine(tokenizer, plugins=(FailMarkedPrompts(),))
    with running_server(engine) as (url, _):
        yield url, engine


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_until(check, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_completion_is_token_for_token_transformers_greedy(client, served, tokenizer):
    engine = served[1]
    prompt = "The capital of France is"
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    expected = hf_greedy(engine.model, tokenizer(prompt)["input_ids"], 12)
    assert result.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 12
    assert result.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    ids = client.completions.create(model=MODEL, prompt=tokenizer(prompt)["input_ids"], max_tokens=12, **GREEDY)
    assert ids.choices[0].text == result.choices[0].text


def test_streamed_chat_concatenates_to_the_non_streamed_greedy_answer(client):
    messages = chat("Tell me a story about a dragon.")
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, **GREEDY)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 40
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5  # it really streamed


def test_n_samples_come_back_as_separate_choices(client):
    result = client.chat.completions.create(
        model=MODEL, messages=chat("hello"), max_tokens=10, n=2, temperature=1.0, seed=7,
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.choices[0].message.content != result.choices[1].message.content
    streamed = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=6, n=2, stream=True, **GREEDY))
    texts = {0: "", 1: ""}
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts[0] == texts[1] != ""


def test_stop_string_cuts_the_text_streamed_or_not(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, **GREEDY)
    text = full.choices[0].text
    stop = text[10:13]
    cut = text.find(stop)
    result = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, stop=[stop], **GREEDY)
    assert result.choices[0].text == text[:cut]
    assert result.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, stop=stop, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]


def test_32_concurrent_streaming_clients_all_finish_in_shared_steps(served):
    url, engine = served
    peak_before = engine.stats.peak_running

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=chat(f"request number {i}"), max_tokens=16, stream=True, **GREEDY
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert [finish for _, finish in results] == ["length"] * 32
    assert engine.stats.peak_running >= 8 or peak_before >= 8  # the clients shared engine steps
    wait_until(lambda: metrics(url)["pagedkv:kv_cache_blocks_used"] == 0)


def test_client_that_disconnects_mid_stream_gives_its_blocks_back(client, served):
    url, engine = served
    generated_before = engine.stats.generated_tokens
    stream = client.completions.create(model=MODEL, prompt="a long answer", max_tokens=450, stream=True, **GREEDY)
    for _, _chunk in zip(range(3), stream):
        pass
    assert metrics(url)["pagedkv:kv_cache_blocks_used"] > 0
    stream.close()
    wait_until(lambda: metrics(url)["pagedkv:kv_cache_blocks_used"] == 0 and not engine.has_unfinished())
    assert engine.stats.generated_tokens - generated_before < 450  # aborted, not run to its end
    assert engine.pool.num_available == engine.num_blocks


def test_non_streaming_client_that_goes_away_aborts_its_request(served):
    url, engine = served
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 450, "ignore_eos": True,
                                                  "temperature": 0}, timeout=0.3)
    wait_until(lambda: not engine.has_unfinished() and engine.pool.num_available == engine.num_blocks)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": list(range(1, 300)) * 2}, "prompt"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo (the prompt alone)
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 4}, "prompt"),
])
def test_each_invalid_completion_field_answers_400_naming_it(served, body, param):
    response = httpx.post(served[0] + "/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_bad_chat_requests_answer_400_and_good_ones_still_work(served, client):
    url = served[0]
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": chat("hi"), "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": chat("hi"), "tools": [{"type": "function"}]}, "tools[0].function.name"),
        ({"messages": chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ]:
        response = httpx.post(url + "/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert httpx.post(url + "/v1/chat/completions", content=b"{not json").status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="some-other-model", messages=chat("hi"), max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2, temperature=5)
    assert info.value.body["param"] == "temperature"
    ok = client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_request_failing_inside_a_step_ends_alone(served, client):
    async def both() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=served[0], timeout=60) as http:
            bad = http.post("/v1/completions", json={"prompt": [FAIL_TOKEN, 9, 9], "max_tokens": 5})
            good = http.post("/v1/completions", json={"prompt": [7, 9, 9], "max_tokens": 5, "ignore_eos": True})
            return await asyncio.gather(bad, good)

    bad, good = asyncio.run(both())
    assert bad.status_code == 500 and "marked to fail" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 5
    with pytest.raises(openai.APIError, match="marked to fail"):
        list(client.completions.create(model=MODEL, prompt=[FAIL_TOKEN, 1], max_tokens=4, stream=True))
    assert client.completions.create(model=MODEL, prompt=[7, 1], max_tokens=4).choices[0].finish_reason


def test_models_health_and_metrics(served, client):
    url = served[0]
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").status_code == 200
    client.completions.create(model=MODEL, prompt="count", max_tokens=4, **GREEDY)
    values = metrics(url)
    for name in ("pagedkv:num_requests_running", "pagedkv:num_requests_waiting", "pagedkv:num_requests_swapped",
                 "pagedkv:kv_cache_usage_perc", "pagedkv:num_preemptions_total", "pagedkv:prefix_cache_queries_total",
                 "pagedkv:prefix_cache_hits_total"):
        assert name in values
    assert values["pagedkv:generation_tokens_total"] >= 4
    assert values["pagedkv:prompt_tokens_total"] >= 1
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert values[f"pagedkv:{histogram}_count"] >= 1
    assert values["pagedkv:kv_cache_usage_perc"] == 0.0


def test_a_full_waiting_queue_answers_503_with_retry_after(tokenizer):
    engine = tiny_chat_engine(tokenizer, max_num_seqs=1)
    with running_server(engine, max_waiting=1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        long_one = client.completions.create(model=MODEL, prompt="a", max_tokens=450, stream=True, **GREEDY)
        next(iter(long_one))  # running: max_num_seqs=1, so the next request waits

        async def queued() -> httpx.Response:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                return await http.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            waiting = asyncio.create_task(queued())
            while metrics(url)["pagedkv:num_requests_waiting"] < 1:
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                refused = await http.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
            long_one.close()  # the running request goes away: the waiting one runs
            return refused, await waiting

        refused, served_later = asyncio.run(scenario())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert served_later.status_code == 200


def test_api_key_guards_v1_routes_only(tokenizer):
    with running_server(tiny_chat_engine(tokenizer), api_key="sekrit") as (url, _):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200


def test_chat_without_a_chat_template_is_a_clear_400_and_completions_work():
    plain = byte_level_tokenizer(chat_template=False)
    with running_server(tiny_chat_engine(plain)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template") as info:
            client.chat.completions.create(model=MODEL, messages=chat("hi"), max_tokens=2)
        assert info.value.body["param"] == "messages"
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None


def test_a_step_that_raises_fails_the_requests_in_it_and_the_server_goes_on(served, client, monkeypatch):
    url, engine = served
    real_execute = engine.runner.execute
    calls = []

    def broken_once(out):
        if not calls:
            calls.append(out)
            raise RuntimeError("injected step failure")
        return real_execute(out)

    monkeypatch.setattr(engine.runner, "execute", broken_once)
    failed = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60)
    assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3, **GREEDY).usage.completion_tokens == 3
    wait_until(lambda: engine.pool.num_available == engine.num_blocks)
    assert httpx.get(url + "/health").status_code == 200
