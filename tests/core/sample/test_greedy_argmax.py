"""A greedy request without logprobs costs an argmax over the vocabulary, never a softmax or log-softmax (the
batch-1 hot path: SmolLM2 has 49,152 logits a token); the tokens are the same as the full path gives."""

from __future__ import annotations

import pytest
import torch

from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core.sample.sampler import Sampler
from pagedkv.core.sample.sampling_batch import SamplingBatch

VOCAB = 300
NAMES = ("softmax", "log_softmax")


@pytest.fixture
def softmax_calls(monkeypatch):
    """How many times any softmax / log-softmax entry point ran (torch.*, torch.nn.functional.*, Tensor.*)."""
    calls = []

    def counting(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for owner in (torch, torch.nn.functional, torch.Tensor):
        for name in NAMES:
            counting(owner, name)
    return calls


def _batch(params: list[SamplingParams]) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params, [[1, 2, 3]] * n, [[4]] * n, [()] * n, list(range(n)))


@pytest.mark.parametrize("extra", [{}, {"repetition_penalty": 1.3}, {"logit_bias": {5: 2.0}}])
def test_greedy_rows_without_logprobs_take_an_argmax_not_a_softmax(softmax_calls, extra):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, **extra) for _ in range(4)]
    expected = Sampler().sample(logits, _batch([SamplingParams(temperature=0.0, logprobs=0, **extra)] * 4)).tokens
    softmax_calls.clear()  # (the reference above asked for logprobs: it may softmax)
    got = Sampler().sample(logits, _batch(params))
    assert softmax_calls == []
    assert got.tokens == expected
    if not extra:
        assert got.tokens == logits.argmax(-1).tolist()


def test_the_detector_sees_the_softmax_a_logprobs_request_needs(softmax_calls):
    Sampler().sample(torch.randn(2, VOCAB), _batch([SamplingParams(temperature=0.0, logprobs=1)] * 2))
    assert softmax_calls  # the counting fixture does catch the sampler's log-softmax


def test_an_engine_greedy_step_samples_without_a_softmax(tiny_llama, monkeypatch):
    engine = Engine(EngineConfig(device="cpu", backend="torch", num_blocks=64, block_size=4), model=tiny_llama)
    seen = []
    sample = engine.sampler.sample

    def spy(logits, batch):  # the sampler as the engine calls it, softmax counted only inside it
        before = len(calls)
        out = sample(logits, batch)
        seen.append(len(calls) - before)
        return out

    calls: list[str] = []
    monkeypatch.setattr(engine.sampler, "sample", spy)
    for owner in (torch, torch.nn.functional, torch.Tensor):
        for name in NAMES:
            original = getattr(owner, name)
            monkeypatch.setattr(owner, name, lambda *a, _o=original, _n=name, **k: (calls.append(_n), _o(*a, **k))[1])
    for _ in range(2):
        engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step(stream=False)
    assert len(seen) == 6 and sum(seen) == 0, seen
    assert engine.pool.num_available == engine.num_blocks
