"""``echo`` with ``logprobs`` on /v1/completions (lm-eval's loglikelihood request) and ``prompt_logprobs`` ranks.

The prompt's tokens lead the legacy logprobs object, the first one ``null`` (nothing predicts it), as
vLLM's server answers; their values are the engine's prompt logprobs, and transformers' own
log-softmax of the same tiny model's logits.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from serve_helpers import running_server, tiny_chat_engine

from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve.testing import byte_level_tokenizer
from pagedkv.testing import tiny_llama

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def url(tokenizer):
    with running_server(tiny_chat_engine(tokenizer)) as (base, _):
        yield base


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    return list(tokenizer(PROMPT)["input_ids"])


@pytest.fixture(scope="module")
def hf_logprobs(tokenizer, ids) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at each prompt position (the same seeded weights)."""
    model = tiny_llama(vocab_size=len(tokenizer))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def completions(url: str, **body) -> dict:
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(url: str, **body) -> list[dict]:
    response = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    assert response.status_code == 200, response.text
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


LM_EVAL = {"max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}  # lm-eval local-completions' body


def test_echo_with_logprobs_leads_with_the_prompt_tokens_first_null(url, ids, tokenizer):
    body = completions(url, prompt=[ids], **LM_EVAL)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(ids) + 1 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert all(isinstance(top, dict) and len(top) == 1 for top in lp["top_logprobs"][1:])
    assert lp["tokens"][: len(ids)] == [tokenizer.decode([t]) for t in ids]
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    assert choice["text"].startswith(PROMPT)
    assert body["usage"]["completion_tokens"] == 1 and body["usage"]["prompt_tokens"] == len(ids)


def test_echoed_prompt_logprobs_are_the_engines_prompt_logprobs_and_transformers(url, ids, tokenizer, hf_logprobs):
    lp = completions(url, prompt=[ids], **LM_EVAL)["choices"][0]["logprobs"]
    reference = tiny_chat_engine(tokenizer)
    reference.add_request(list(ids), SamplingParams(max_tokens=1, prompt_logprobs=1))
    finished = []
    while reference.has_unfinished():
        finished += [out for out in reference.step(stream=False) if out.finished]
    direct = finished[0].prompt_logprobs
    for position in range(1, len(ids)):
        token = ids[position]
        assert lp["token_logprobs"][position] == pytest.approx(direct[position][token], abs=1e-6)
        assert lp["token_logprobs"][position] == pytest.approx(hf_logprobs[position - 1, token].item(), abs=1e-4)
        best = hf_logprobs[position - 1].max().item()
        assert list(lp["top_logprobs"][position].values())[0] == pytest.approx(best, abs=1e-4)


def test_echo_with_logprobs_streamed_matches_the_whole_answer(url, ids):
    whole = completions(url, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, temperature=0,
                        ignore_eos=True)["choices"][0]
    chunks = streamed(url, prompt=PROMPT, max_tokens=4, logprobs=2, echo=True, temperature=0, ignore_eos=True)
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) > len(ids)
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in joined:
            joined[key] += chunk["choices"][0]["logprobs"][key]
    assert joined == whole["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_echo_with_max_tokens_0_answers_the_prompt_alone(url, ids):
    body = completions(url, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True)
    choice = body["choices"][0]
    assert choice["text"] == PROMPT
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["token_logprobs"][0] is None
    # vLLM samples one token to run the prompt (max_tokens 1 inside) and its usage counts it
    assert body["usage"]["completion_tokens"] == 1 and body["usage"]["prompt_tokens"] == len(ids)
    chunks = streamed(url, prompt=PROMPT, max_tokens=0, logprobs=1, echo=True,
                      stream_options={"include_usage": True})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    chunks = chunks[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(ids)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_0_without_echo_is_refused_by_name(url):
    response = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_entries_carry_their_vocabulary_rank(url, ids, hf_logprobs):
    k = 3
    choice = completions(url, prompt=PROMPT, max_tokens=1, prompt_logprobs=k)["choices"][0]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for position in range(1, len(ids)):
        entry, row = entries[position], hf_logprobs[position - 1]
        assert all(list(item) == ["logprob", "rank", "decoded_token"] for item in entry.values())
        token = ids[position]
        assert entry[str(token)]["rank"] == int((row >= row[token] - 1e-6).sum())  # 1-based, ties counted
        tops = sorted((item for t, item in entry.items() if t != str(token) or item["rank"] <= k),
                      key=lambda item: -item["logprob"])
        assert [item["rank"] for item in tops] == list(range(1, k + 1))
