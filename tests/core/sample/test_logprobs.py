"""Logprobs of generated and prompt tokens equal log_softmax of transformers' own forward pass."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_prompts
from pagedkv import LLM, SamplingParams

ATOL = 1e-4  # float32, paged attention vs sdpa


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """``[len, vocab]`` log-softmax of the raw logits; row p predicts token p + 1."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(previous)
    return torch.log_softmax(logits, dim=-1)


def assert_entry(entry: dict[int, float], row: torch.Tensor, token: int, k: int) -> None:
    top_values, top_ids = row.topk(k)
    assert list(entry)[0] == token
    assert set(entry) == {token, *top_ids.tolist()}
    for t, value in entry.items():
        assert value == pytest.approx(float(row[t]), abs=ATOL)
    assert [t for t in entry if t != token][: k - 1] == [t for t in top_ids.tolist() if t != token][: k - 1]


def check_request(model, out, k: int | None, prompt_k: int | None) -> None:
    prompt = out.prompt_token_ids
    for completion in out.outputs:
        reference = hf_logprobs(model, prompt + completion.token_ids)
        if k is None:
            assert completion.logprobs is None and completion.cumulative_logprob is None
        else:
            assert len(completion.logprobs) == len(completion.token_ids)
            total = 0.0
            for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
                row = reference[len(prompt) - 1 + i]
                if k:
                    assert_entry(entry, row, token, k)
                assert entry[token] == pytest.approx(float(row[token]), abs=ATOL)
                assert len(entry) in ((k, k + 1) if k else (1,))
                total += entry[token]
            assert completion.cumulative_logprob == pytest.approx(total, abs=1e-6)
    if prompt_k is None:
        assert out.prompt_logprobs is None
        return
    reference = hf_logprobs(model, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        assert_entry(out.prompt_logprobs[j], reference[j - 1], prompt[j], max(prompt_k, 1))
        assert len(out.prompt_logprobs[j]) <= prompt_k + 1


def test_greedy_logprobs_and_prompt_logprobs_match_transformers(tiny_llama):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=128, block_size=8)
    prompts = random_prompts([5, 13, 2], seed=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for out in llm.generate(prompts, params):
        check_request(tiny_llama, out, 3, 2)
        assert all(list(e)[0] == max(e, key=e.get) for e in out.outputs[0].logprobs)  # greedy took the top


def test_sampled_logprobs_are_the_raw_model_logprobs(tiny_llama):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=128, block_size=8)
    params = SamplingParams(max_tokens=8, temperature=1.7, top_k=5, seed=3, repetition_penalty=1.5, logprobs=0, n=2)
    out = llm.generate(random_prompts([7], seed=2), params)[0]
    check_request(tiny_llama, out, 0, None)  # not temperature-scaled, not penalized: vLLM's raw_logprobs


def test_no_logprobs_unless_asked(tiny_llama):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=64, block_size=8)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0]
    check_request(tiny_llama, out, None, None)


def test_prompt_logprobs_survive_chunked_prefill_prefix_caching_and_preemption(tiny_llama):
    prompts = random_prompts([40, 40, 33], seed=3)
    prompts[1][:24] = prompts[0][:24]  # a cached prefix the second request must still compute
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=20, block_size=4, max_num_batched_tokens=9,
              enable_prefix_caching=True)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=3)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats.preemptions > 0  # 20 blocks of 4 cannot hold three 52-token requests
    for out in outs:
        check_request(tiny_llama, out, 1, 3)
    assert llm.engine.pool.num_available == llm.engine.num_blocks


def test_engine_run_flags_reach_sampling_and_json_shows_logprobs(smollm2_dir, capsys):
    from pagedkv.cli.main import main

    argv = ["run", "--json", "--max-tokens", "5", "--prompt", "Say hi.", "--num-blocks", "32", "--temperature", "0.8",
            "--min-p", "0.05", "--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty",
            "0.5", "--logprobs", "2"]
    assert main(argv) == 0
    completion = json.loads(capsys.readouterr().out)["completions"][0]
    assert 1 <= len(completion["logprobs"]) <= 5 and all(2 <= len(entry) <= 3 for entry in completion["logprobs"])
    assert completion["cumulative_logprob"] == pytest.approx(
        sum(next(iter(entry.values())) for entry in completion["logprobs"]), abs=1e-6
    )
    assert main(["run", "--max-tokens", "2", "--num-blocks", "32", "--presence-penalty", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "engine: error: presence_penalty must be in [-2.0, 2.0], got 3.0\n"


@pytest.mark.parametrize("copy_on_write", [False, True])
def test_forked_samples_get_their_own_logprobs_next_to_prompt_rows(tiny_llama, copy_on_write):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=64, block_size=4, enable_copy_on_write=copy_on_write)
    params = SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=8, logprobs=2, prompt_logprobs=1)
    for prompt in ([6, 7, 8], [1, 2, 3, 4, 5]):  # 3 tokens: as many logits rows (2 prompt, 1 shared) as samples
        out = llm.generate([prompt], params)[0]
        check_request(tiny_llama, out, 2, 1)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_ranked_entries_know_each_ids_vocabulary_rank_and_survive_pickling():
    import pickle

    from pagedkv.core.sample.logprobs import RankedLogprobs, token_logprobs

    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 2.5], [5.0, 4.0, 3.0, 2.0, 1.0], [1.0, 0.0, 1.0, 0.0, 0.0]])
    first, second, tied = token_logprobs(logits, [2, 0, 0], [2, 2, 0], ranked=True)
    assert isinstance(first, RankedLogprobs) and list(first) == [2, 1, 4]
    assert first.ranks == {2: 4, 1: 1, 4: 2}
    assert second.ranks == {0: 1, 1: 2}  # the given id among the top ranks by its place
    assert tied.ranks == {0: 2}  # an id as likely counts above it (vLLM's rank)
    again = pickle.loads(pickle.dumps(first))
    assert again == first and again.ranks == first.ranks
    assert not hasattr(token_logprobs(logits, [2, 0], [1, 1])[0], "ranks")  # generated tokens: plain dicts
