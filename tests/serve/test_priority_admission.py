"""A full waiting queue under the priority policy: a strictly better newcomer evicts the worst waiting request."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from serve_helpers import MODEL, running_server, tiny_chat_engine

from pagedkv.serve.testing import byte_level_tokenizer

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def waiting(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("pagedkv:num_requests_waiting"):
            return float(line.split()[-1])
    raise AssertionError("no waiting gauge")


async def post(url: str, priority: int, stream: bool = False) -> httpx.Response:
    body = {"prompt": "b", "max_tokens": 2, "priority": priority, "stream": stream}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await http.post("/v1/completions", json=body)


async def until_waiting(url: str, count: int) -> None:
    deadline = time.monotonic() + 30
    while waiting(url) < count:
        assert time.monotonic() < deadline, "the request never queued"
        await asyncio.sleep(0.05)


def test_a_strictly_better_newcomer_evicts_the_worst_waiting_request_which_gets_503(tokenizer):
    engine = tiny_chat_engine(tokenizer, max_num_seqs=1, scheduler="priority")
    with running_server(engine, max_waiting=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        long_one = client.completions.create(model=MODEL, prompt="a", max_tokens=450, stream=True, **GREEDY)
        next(iter(long_one))  # running: max_num_seqs=1, so the others wait

        async def scenario() -> tuple[httpx.Response, ...]:
            old_low = asyncio.create_task(post(url, 10))
            await until_waiting(url, 1)
            new_low = asyncio.create_task(post(url, 10, stream=True))
            await until_waiting(url, 2)  # the queue (2) is full of priority 10
            same = await post(url, 10)  # not strictly better: today's answer
            urgent = asyncio.create_task(post(url, -1000))  # evicts the newest priority-10 request
            evicted = await asyncio.wait_for(new_low, 30)
            long_one.close()
            return same, evicted, await urgent, await old_low

        same, evicted, urgent, old_low = asyncio.run(scenario())
        assert same.status_code == 503 and same.headers["retry-after"] == "1"
        assert evicted.status_code == 200  # a stream: its 200 went out when it was queued
        events = [line for line in evicted.text.splitlines() if line.startswith("data: ")]
        assert '"code":503' in events[0].replace(" ", "") and "service_unavailable" in events[0]
        assert events[-1] == "data: [DONE]"
        assert urgent.status_code == 200 and old_low.status_code == 200
        for _ in range(100):
            if not engine.has_unfinished():
                break
            time.sleep(0.05)
    assert engine.pool.num_available == engine.num_blocks
    engine.check_invariants()


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_an_evicted_whole_answer_request_gets_503_with_retry_after_and_fcfs_never_evicts(tokenizer, policy):
    evicts = policy == "priority"
    engine = tiny_chat_engine(tokenizer, max_num_seqs=1, scheduler=policy)
    with running_server(engine, max_waiting=1) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        long_one = client.completions.create(model=MODEL, prompt="a", max_tokens=450, stream=True, **GREEDY)
        next(iter(long_one))

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            low = asyncio.create_task(post(url, 7 if evicts else 0))
            await until_waiting(url, 1)
            newcomer = asyncio.create_task(post(url, -7 if evicts else 0))
            first = (await asyncio.wait_for(low, 30)) if evicts else (await newcomer)
            long_one.close()
            return first, (await newcomer) if evicts else (await low)

        refused, served = asyncio.run(scenario())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert served.status_code == 200
        for _ in range(100):
            if not engine.has_unfinished():
                break
            time.sleep(0.05)
    assert engine.pool.num_available == engine.num_blocks
