"""Sampling: seeds, top-k/top-p limits, stop conditions, n > 1."""

from __future__ import annotations

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.core.sample.sampler import Sampler
from pagedkv.core.sample.sampling_batch import SamplingBatch


def make_llm(model, **kw):
    return LLM(hf_model=model, device="cpu", num_blocks=128, block_size=8, **kw)


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama):
    llm = make_llm(tiny_llama)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params)[0].token_ids
    crowd = llm.generate([[9, 9], [5, 6, 7], [1, 2, 3, 4]], [SamplingParams(max_tokens=5), params, params])
    assert crowd[1].token_ids == alone
    other = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))
    assert other[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(tiny_llama):
    llm = make_llm(tiny_llama)
    greedy = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    top_k = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, temperature=5.0, top_k=1, seed=1))[0]
    top_p = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, temperature=5.0, top_p=1e-6, seed=1))[0]
    assert top_k.token_ids == greedy and top_p.token_ids == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.7)  # no seed: each row draws from its own generator
    batch = SamplingBatch([params] * 200, [[1]] * 200, [[]] * 200, [()] * 200, list(range(200)))
    seen = set(Sampler().sample(logits.expand(200, -1), batch).tokens)
    assert seen == {0, 1}


def test_stop_token_and_eos_end_a_request_unless_ignored(tiny_llama):
    llm = make_llm(tiny_llama)
    free_run = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_at = free_run.token_ids[3]
    first = free_run.token_ids.index(stop_at)
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == free_run.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_at
    llm.engine.eos_token_ids = frozenset([stop_at])
    eos = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10))[0]
    assert eos.token_ids == free_run.token_ids[: first + 1]
    ignored = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert ignored.token_ids == free_run.token_ids and ignored.outputs[0].finish_reason == "length"


def test_min_tokens_holds_back_eos(tiny_llama):
    llm = make_llm(tiny_llama)
    free_run = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    llm.engine.eos_token_ids = frozenset([free_run[0]])
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, min_tokens=3))[0].token_ids
    assert len(out) >= 3 and free_run[0] not in out[:3]


def test_n_samples_come_back_together_and_differ(tiny_llama):
    llm = make_llm(tiny_llama)
    out = llm.generate([[3, 4, 5]], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.pool.num_free == llm.engine.num_blocks
