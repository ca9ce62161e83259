"""SamplingParams refuses, on construction, every value that could break a step (issue 16 item 1)."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.core.errors import RequestRejected
from pagedkv.core.sample.sampling_params import MAX_SEED, MAX_TOKENS_LIMIT, MIN_TEMPERATURE

NAN, INF = float("nan"), float("inf")

BAD = [
    ("temperature", NAN), ("temperature", INF), ("temperature", -0.1), ("temperature", "1"), ("temperature", True),
    ("top_p", NAN), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -INF),
    ("top_k", -2), ("top_k", 2.0), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", NAN),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", INF),
    ("presence_penalty", 2.5), ("presence_penalty", NAN), ("frequency_penalty", -2.5), ("frequency_penalty", INF),
    ("seed", -1), ("seed", MAX_SEED + 1), ("seed", 1.0), ("seed", True), ("seed", "7"),
    ("n", 0), ("n", 129), ("n", 10**9), ("n", 2.0), ("n", True),
    ("max_tokens", 0), ("max_tokens", MAX_TOKENS_LIMIT + 1), ("max_tokens", 1.5), ("max_tokens", None),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", False),
    ("stop", [""]), ("stop", [1]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 3), ("stop_token_ids", [True]),
    ("ignore_eos", 1),
    ("logit_bias", {1: NAN}), ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"1": 1.0}),
    ("logit_bias", [(1, 1.0)]), ("logit_bias", {True: 1.0}),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", "2"),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_value_is_refused_with_one_line_naming_the_field(name, value):
    with pytest.raises(RequestRejected) as info:
        SamplingParams(**{name: value})
    message = str(info.value)
    assert "\n" not in message and name.split("_")[0] in message


def test_good_values_are_kept_and_normalized():
    p = SamplingParams(
        max_tokens=MAX_TOKENS_LIMIT, temperature=1, top_k=-1, top_p=0.5, min_p=0.1, seed=MAX_SEED, n=1, stop="x",
        stop_token_ids=(3, 4), repetition_penalty=1.2, presence_penalty=-2, frequency_penalty=2, logit_bias={5: -100},
        logprobs=0, prompt_logprobs=20,
    )
    assert p.top_k == 0 and p.stop == ["x"] and p.stop_token_ids == [3, 4]
    assert isinstance(p.temperature, float) and p.logit_bias == {5: -100.0}
    assert SamplingParams(temperature=1e-9).temperature == MIN_TEMPERATURE  # vLLM raises tiny temperatures


def test_seed_leaves_room_for_every_sample():
    SamplingParams(seed=MAX_SEED - 3, n=4)
    with pytest.raises(RequestRejected, match="seed"):
        SamplingParams(seed=MAX_SEED - 2, n=4)


@pytest.fixture
def llm(tiny_llama):
    return LLM(hf_model=tiny_llama, device="cpu", num_blocks=64, block_size=8)


@pytest.mark.parametrize("bad", [{"temperature": NAN}, {"seed": 2**64}, {"seed": -1}, {"n": 10**9}])
def test_parameters_that_used_to_break_step_for_everyone_are_refused_and_others_finish(llm, bad):
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=1.0, seed=3))
    with pytest.raises(RequestRejected):
        engine.add_request([4, 5, 6], SamplingParams(**{"max_tokens": 4, "temperature": 1.0, **bad}))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step(stream=False)
    assert [len(o.token_ids) for o in outputs] == [4]
    assert engine.pool.num_free == engine.num_blocks


def test_params_edited_after_construction_are_checked_again_and_copied(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3)
    params.seed = 2**64  # a dataclass can be edited after its checks ran
    with pytest.raises(RequestRejected, match="seed"):
        engine.add_request([1, 2, 3], params)
    params.seed = 3
    engine.add_request([1, 2, 3], params)
    params.temperature = NAN  # too late to reach the queued request
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step(stream=False)
    assert len(outputs[0].token_ids) == 4


def test_extreme_but_valid_parameters_run(llm):
    params = [
        SamplingParams(max_tokens=3, temperature=1e-9, seed=MAX_SEED),
        SamplingParams(max_tokens=3, temperature=1e6, seed=0, repetition_penalty=1e-30, logit_bias={1: 100.0}),
        SamplingParams(max_tokens=3, temperature=0.5, top_k=10**9, top_p=1e-9, min_p=1.0, presence_penalty=2),
    ]
    outs = llm.generate([[1, 2, 3]] * 3, params)
    assert all(len(o.token_ids) == 3 and all(0 <= t < 211 for t in o.token_ids) for o in outs)


@pytest.mark.parametrize("field", ["stop_token_ids", "logit_bias"])
def test_token_ids_outside_the_vocabulary_are_refused_at_add_request(llm, field):
    value = [211] if field == "stop_token_ids" else {211: 1.0}
    with pytest.raises(RequestRejected, match=f"{field}.*211"):
        llm.engine.add_request([1, 2], SamplingParams(**{field: value}))
    assert not llm.engine.has_unfinished()


def test_generate_checks_every_request_before_running_any(llm):
    good = SamplingParams(max_tokens=2)
    bad = SamplingParams(max_tokens=2, logit_bias={5: 1.0})
    bad.logit_bias[999] = 1.0  # outside the vocabulary of 211
    with pytest.raises(RequestRejected, match="logit_bias"):
        llm.generate([[1, 2], [3, 4]], [good, bad])
    assert not llm.engine.has_unfinished()
