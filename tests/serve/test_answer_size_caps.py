"""Answer-size and body-size caps (issue 42, rows 9 and 10): a clear 400 naming the field, and a big answer
or body that does not hold the event loop (/health stays fast while it is built)."""

from __future__ import annotations

import asyncio
import gc
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse
from serve_helpers import running_server, tiny_chat_engine

from pagedkv.core.sched.sequence import CompletionOutput, RequestOutput
from pagedkv.serve.answer_json import _pieces, encode_json
from pagedkv.serve.heap import freeze_startup_heap
from pagedkv.serve.http.body_budget import BodyBudget
from pagedkv.serve.logprobs_format import TokenTexts
from pagedkv.serve.responses import Job, collect
from pagedkv.serve.testing import byte_level_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def url(tokenizer):
    with running_server(tiny_chat_engine(tokenizer, max_num_seqs=64), max_request_bytes=8 << 20) as (base, _):
        yield base


def _param(response: httpx.Response, status: int = 400) -> str:
    assert response.status_code == status, response.text[:500]
    return response.json()["error"]["param"]


def test_prompt_logprobs_over_a_context_of_tokens_per_request_is_400_naming_the_field(url):
    prompts = [[7] * 200 for _ in range(4)]  # 800 prompt tokens with logprobs; the context is 512
    body = {"prompt": prompts, "max_tokens": 1, "prompt_logprobs": 1}
    assert _param(httpx.post(url + "/v1/completions", json=body, timeout=60)) == "prompt_logprobs"
    echo = {"prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 1}  # echoed logprobs are prompt logprobs
    assert _param(httpx.post(url + "/v1/completions", json=echo, timeout=60)) == "echo"
    fits = {"prompt": prompts[:2], "max_tokens": 1, "prompt_logprobs": 1}
    assert httpx.post(url + "/v1/completions", json=fits, timeout=60).status_code == 200


def test_tokenize_over_the_context_is_400_naming_prompt_and_detokenize_naming_tokens(url):
    assert _param(httpx.post(url + "/tokenize", json={"prompt": "ab " * 600}, timeout=60)) == "prompt"
    started = time.monotonic()
    many = httpx.post(url + "/detokenize", json={"tokens": [65] * 1_000_000}, timeout=60)  # 4 MB of ids
    assert _param(many) == "tokens"
    assert time.monotonic() - started < 5  # refused from its size, not after parsing a million ids
    assert _param(httpx.post(url + "/detokenize", json={"tokens": [65] * 600}, timeout=60)) == "tokens"
    fits = httpx.post(url + "/tokenize", json={"prompt": "ab " * 50}, timeout=60)
    assert fits.status_code == 200 and fits.json()["count"] <= 512
    assert httpx.post(url + "/detokenize", json={"tokens": fits.json()["tokens"]}, timeout=60).status_code == 200


class _Observer:
    def observe(self, value: float) -> None:
        pass


class _OneOutput:
    """A request handle that yields one finished output (what collect() reads)."""

    def __init__(self, output: RequestOutput) -> None:
        self.output, self.request_id, self.done = output, output.request_id, False

    def __aiter__(self) -> _OneOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        self.done = True
        return self.output

    def close(self) -> None:
        pass


def _big_job(tokenizer, samples: int = 16, tokens: int = 400) -> Job:
    entry = {t: -0.1 * t for t in range(60, 81)}  # the sampled token and 20 more
    outs = [CompletionOutput(i, "x" * tokens, [60] * tokens, "length", None, None, [entry] * tokens, -1.0)
            for i in range(samples)]
    metrics = SimpleNamespace(ttft=_Observer(), itl=_Observer(), e2e=_Observer(), finished=lambda reason: None)
    handle = _OneOutput(RequestOutput("r-0", None, [1, 2], outs, True))
    return Job(True, "chatcmpl-x", "tiny", samples, [handle], 2, 0, metrics, 20, TokenTexts(tokenizer))


def test_a_big_logprobs_answer_is_built_off_the_event_loop_and_encoded_in_short_pieces(tokenizer):
    async def main() -> tuple[float, float, Any]:
        gaps = [0.0]
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps[0], last = max(gaps[0], now - last), now

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.01)
        started = time.perf_counter()
        with ThreadPoolExecutor(1) as pool:
            status, body = await collect(_big_job(tokenizer), pool)
        took = time.perf_counter() - started
        done.set()
        await ticker
        assert status == 200
        return took, gaps[0], body

    freeze_startup_heap()  # as the server does at startup (else one full collection walks torch's heap, ~0.4 s)
    try:
        took, gap, body = asyncio.run(main())
    finally:
        gc.unfreeze()
    # ratios, not seconds (a shared machine): on the loop, the loop stalls for the whole build
    assert gap < 0.5 * took, f"the event loop stalled {gap:.3f} s of a {took:.3f} s build"
    pieces = _pieces(body, 0)
    assert max(map(len, pieces)) < 64 << 10  # no encoder call covers more than a few token entries
    assert encode_json(body) == JSONResponse(body).body  # the bytes Starlette would have sent


def test_the_body_budget_makes_a_body_wait_until_others_are_done():
    async def main() -> None:
        budget = BodyBudget(100)
        await budget.take(60)
        second = asyncio.ensure_future(budget.take(60))
        await asyncio.sleep(0.05)
        assert not second.done()  # 120 bytes would be over 100
        budget.give(60)
        await asyncio.wait_for(second, 1)
        budget.give(60)
        await asyncio.wait_for(budget.take(500), 1)  # alone, a body over the budget still goes (the size cap rules)
        assert budget.in_flight == 500

    asyncio.run(main())
