"""A batch file's completion with ``echo`` and ``logprobs`` (lm-eval's loglikelihood body) answers as engine serve
does: the same body run through a batch file and through a live server on the same tiny model gives the same text,
legacy logprobs (the prompt's tokens first, the first ``null``) and usage; ``max_tokens: 0`` too (the prompt alone,
the one sampled token counted in usage as vLLM counts it). Before, batch files refused echo with logprobs."""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import running_server, tiny_chat_engine

from pagedkv.cli.batch_file import run_batch
from pagedkv.serve.testing import byte_level_tokenizer

BODIES = {
    "lm-eval": {"prompt": "The quick brown fox", "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0},
    "ids": {"prompt": [[5, 6, 7, 8], [9, 10]], "max_tokens": 3, "logprobs": 2, "echo": True, "temperature": 0,
            "ignore_eos": True},
    "echo-only": {"prompt": "Hello world", "max_tokens": 0, "logprobs": 1, "echo": True},
}


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer):
    with running_server(tiny_chat_engine(tokenizer)) as (url, _):
        yield {name: httpx.post(url + "/v1/completions", json=body, timeout=60).json()
               for name, body in BODIES.items()}


@pytest.fixture(scope="module")
def batched(tokenizer):
    lines = [json.dumps({"custom_id": name, "url": "/v1/completions", "body": body}) for name, body in BODIES.items()]
    written: list[dict] = []
    engine = tiny_chat_engine(tokenizer)
    assert run_batch(engine, lines, written.append, "tiny") == (len(BODIES), 0), written
    assert engine.pool.num_used == 0
    return {line["custom_id"]: line["response"]["body"] for line in written}


@pytest.mark.parametrize("name", list(BODIES))
def test_a_batch_line_answers_echo_with_logprobs_as_the_server(served, batched, name):
    server, batch = served[name], batched[name]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the server adds its prefix-cache hits
    assert {k: batch["usage"][k] for k in counts} == {k: server["usage"][k] for k in counts}
    assert len(batch["choices"]) == len(server["choices"])
    for ours, theirs in zip(batch["choices"], server["choices"]):
        assert ours["text"] == theirs["text"] and ours["finish_reason"] == theirs["finish_reason"]
        mine, served_lp = ours["logprobs"], theirs["logprobs"]
        assert mine["tokens"] == served_lp["tokens"] and mine["text_offset"] == served_lp["text_offset"]
        assert mine["token_logprobs"][0] is None and mine["top_logprobs"][0] is None
        assert mine["token_logprobs"][1:] == pytest.approx(served_lp["token_logprobs"][1:], abs=1e-6)
        assert [list(top) for top in mine["top_logprobs"][1:]] == [list(top) for top in served_lp["top_logprobs"][1:]]


def test_echo_only_shows_the_prompt_and_counts_the_sampled_token(tokenizer, batched):
    choice = batched["echo-only"]["choices"][0]
    assert choice["text"] == "Hello world"
    assert len(choice["logprobs"]["tokens"]) == len(tokenizer("Hello world")["input_ids"])
    assert batched["echo-only"]["usage"]["completion_tokens"] == 1  # vLLM samples (and counts) one token
