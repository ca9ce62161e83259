"""engine serve's sampling fields (logprobs, penalties, logit_bias, min_p, seed) over real HTTP with the openai client.

The reference is a second engine with the same tiny model (same seed, same weights) driven directly.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import MODEL, running_server, tiny_chat_engine

from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.serve.testing import byte_level_tokenizer

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def served(tokenizer):
    engine = tiny_chat_engine(tokenizer)
    with running_server(engine) as (url, _):
        yield url, engine


@pytest.fixture(scope="module")
def reference(tokenizer):
    return tiny_chat_engine(tokenizer)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def run_direct(engine, prompt_ids: list[int], **params):
    """The engine's own answer for one request (no server): its RequestOutput."""
    engine.add_request(list(prompt_ids), SamplingParams(**params))
    finished = []
    while engine.has_unfinished():
        finished += [out for out in engine.step(stream=False) if out.finished]
    assert len(finished) == 1
    return finished[0]


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assert_top_list_is_consistent(sampled: float, top: list[float], k: int) -> None:
    assert len(top) == k
    assert top == sorted(top, reverse=True)
    assert all(v <= 0.0 for v in top) and sampled <= 0.0
    assert sampled <= top[0] + 1e-6


def test_completion_logprobs_equal_the_engines_own(client, tokenizer, reference):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, logprobs=3, **GREEDY)
    lp = result.choices[0].logprobs
    direct = run_direct(reference, tokenizer(PROMPT)["input_ids"], max_tokens=10, ignore_eos=True, logprobs=3)
    expected = direct.outputs[0]
    assert result.choices[0].text == expected.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for i, token in enumerate(expected.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(expected.logprobs[i][token], abs=1e-5)
        assert lp.tokens[i] == tokenizer.decode([token])
        engine_top: dict[str, float] = {}  # the legacy {text: logprob} keeps one entry per distinct text
        for t, v in sorted(expected.logprobs[i].items(), key=lambda item: -item[1])[:3]:
            engine_top.setdefault(tokenizer.decode([t]), v)
        assert lp.top_logprobs[i] == pytest.approx(engine_top, abs=1e-5)
        top = list(lp.top_logprobs[i].values())
        assert_top_list_is_consistent(lp.token_logprobs[i], top, len(engine_top))
        assert lp.token_logprobs[i] == pytest.approx(top[0], abs=1e-6)  # greedy: the sampled token is the top one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]


def test_chat_logprobs_match_the_engine_and_their_bytes_spell_the_answer(client, tokenizer, reference):
    content = "Tell me a story about a dragon."
    result = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                            max_tokens=12, logprobs=True, top_logprobs=2, **GREEDY)
    items = result.choices[0].logprobs.content
    expected = run_direct(reference, chat_ids(tokenizer, content), max_tokens=12, ignore_eos=True,
                          logprobs=2).outputs[0]
    assert len(items) == len(expected.token_ids) == result.usage.completion_tokens
    for item, token, entry in zip(items, expected.token_ids, expected.logprobs):
        assert item.logprob == pytest.approx(entry[token], abs=1e-5)
        assert_top_list_is_consistent(item.logprob, [t.logprob for t in item.top_logprobs], 2)
        assert item.top_logprobs[0].token == item.token
    assert bytes(b for item in items for b in item.bytes).decode("utf-8", errors="replace") == \
        result.choices[0].message.content


def test_streamed_logprobs_concatenate_to_the_non_streamed_ones(client):
    messages = [{"role": "user", "content": "Hello world!"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, logprobs=True,
                                           top_logprobs=3, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, logprobs=True,
                                                 top_logprobs=3, stream=True, **GREEDY))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    assert [i.model_dump() for i in streamed] == [i.model_dump() for i in whole.choices[0].logprobs.content]

    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=2, **GREEDY)
    parts = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, logprobs=2, stream=True, **GREEDY) if c.choices[0].logprobs]
    expected = text.choices[0].logprobs
    assert [t for p in parts for t in p.tokens] == expected.tokens
    assert [t for p in parts for t in p.token_logprobs] == expected.token_logprobs
    assert [t for p in parts for t in p.text_offset] == expected.text_offset


def test_each_streamed_choice_carries_its_own_logprobs(client):
    ask = {"model": MODEL, "prompt": [PROMPT, "Hello world!"], "max_tokens": 8, "n": 2, "logprobs": 1, **GREEDY}
    whole = client.completions.create(**ask)
    streamed: dict[int, list[float]] = {}
    for c in client.completions.create(stream=True, **ask):
        for choice in c.choices:
            if choice.logprobs:
                streamed.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
    assert len(whole.choices) == 4
    assert streamed == {c.index: c.logprobs.token_logprobs for c in whole.choices}
    assert streamed[0] == streamed[1] and streamed[0] != streamed[2]  # greedy twins; another prompt


def test_logit_bias_of_plus_100_forces_the_token_and_minus_100_bans_it(client, tokenizer, reference):
    forced = tokenizer.convert_tokens_to_ids("a")
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logit_bias={str(forced): 100},
                                       **GREEDY)
    assert result.choices[0].text == "a" * 6
    ids = tokenizer(PROMPT)["input_ids"]
    first = run_direct(reference, ids, max_tokens=1, ignore_eos=True).outputs[0].token_ids[0]
    banned = run_direct(reference, ids, max_tokens=6, ignore_eos=True, logit_bias={first: -100.0}).outputs[0]
    assert first not in banned.token_ids
    served = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, logit_bias={str(first): -100}, **GREEDY)
    assert served.choices[0].text == banned.text


def test_penalties_equal_the_engine_run_with_the_same_params_and_stop_the_repetition(client, tokenizer, reference):
    ids = tokenizer(PROMPT)["input_ids"]
    plain = run_direct(reference, ids, max_tokens=24, ignore_eos=True).outputs[0].token_ids
    assert len(set(plain)) < len(plain), "the prompt must make the greedy answer repeat itself"
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    served = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, logprobs=0,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.3}, temperature=0.0,
                                       **penalties)
    direct = run_direct(reference, ids, max_tokens=24, ignore_eos=True, repetition_penalty=1.3, **penalties)
    assert served.choices[0].text == direct.outputs[0].text
    penalized = direct.outputs[0].token_ids
    assert len(set(penalized)) > len(set(plain))


def test_seed_and_min_p_make_sampling_reproducible_and_match_the_engine(client, tokenizer, reference):
    ask = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 1234, "extra_body": {"min_p": 0.05,
                                                                                               "ignore_eos": True}}
    first, second = (client.completions.create(model=MODEL, **ask) for _ in range(2))
    assert first.choices[0].text == second.choices[0].text
    direct = run_direct(reference, tokenizer(PROMPT)["input_ids"], max_tokens=12, temperature=1.0, seed=1234,
                        min_p=0.05, ignore_eos=True)
    assert first.choices[0].text == direct.outputs[0].text


def test_prompt_logprobs_come_back_per_prompt_token(client, tokenizer, reference):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1, "ignore_eos": True}, temperature=0.0)
    entries = result.choices[0].model_extra["prompt_logprobs"]
    ids = tokenizer(PROMPT)["input_ids"]
    direct = run_direct(reference, ids, max_tokens=2, ignore_eos=True, prompt_logprobs=1).prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry, expected in zip(ids[1:], entries[1:], direct[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(expected[token], abs=1e-5)


@pytest.mark.parametrize(("url", "body", "param"), [
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"5": "lots"}}, "logit_bias"),
    ("completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "x", "seed": -1}, "seed"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "x", "prompt_logprobs": 99}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "presence_penalty": "high"},
     "presence_penalty"),
])
def test_each_bad_sampling_field_answers_400_naming_it(served, client, url, body, param):
    response = httpx.post(f"{served[0]}/v1/{url}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"], error
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, **GREEDY).choices[0].text is not None
