"""The batched sampler draws from the right distribution, reproducibly per row, and greedy stays argmax."""

from __future__ import annotations

import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pagedkv import LLM, SamplingParams
from pagedkv.core.sample.sampler import Sampler
from pagedkv.core.sample.sampling_batch import SamplingBatch

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, 0.0, -0.5, -3.0])


def batch_of(params: list[SamplingParams], keys: list[int] | None = None, outputs=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params, [[0]] * n, outputs or [[]] * n, [()] * n, keys or list(range(n)))


def expected(params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in vLLM's order (temperature, min-p, top-k, top-p), then softmax."""
    ids, scores = torch.tensor([[0]]), LOGITS.unsqueeze(0).clone()
    scores = TemperatureLogitsWarper(params.temperature)(ids, scores)
    if params.min_p:
        scores = MinPLogitsWarper(params.min_p)(ids, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(ids, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(ids, scores)
    return torch.softmax(scores[0], dim=-1).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the support; a sample outside the support makes it infinite."""
    total = counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return float("inf")
    support = probs > 0
    want = probs[support] * total
    return float(((counts[support] - want) ** 2 / want).sum())


def draw(params: SamplingParams, rows: int = 10000, seed: int = 1234) -> torch.Tensor:
    tokens = Sampler(seed).sample(LOGITS.expand(rows, -1).clone(), batch_of([params] * rows)).tokens
    return torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).double()


def test_samples_follow_the_filtered_distribution():
    # 99.99th percentile of chi-square with <= 7 degrees of freedom is about 29.9: a right sampler passes,
    # while the same draws measured against a distribution missing any one step are far off (checked below)
    cases = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.15),
        SamplingParams(temperature=2.0, top_k=6, top_p=0.9, min_p=0.05),
    ]
    for params in cases:
        counts = draw(params)
        assert chi_square(counts, expected(params)) < 30, params
    wrong = [
        (SamplingParams(temperature=0.6, top_k=5), SamplingParams(temperature=1.0, top_k=5)),
        (SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.3, top_p=0.9)),
        (SamplingParams(temperature=0.9, min_p=0.15), SamplingParams(temperature=0.9)),
    ]
    for params, other in wrong:  # the check has the power to fail
        assert chi_square(draw(params), expected(other)) > 100


def test_logit_bias_and_penalties_shift_samples_as_computed():
    params = SamplingParams(temperature=1.0, logit_bias={7: 4.0}, presence_penalty=1.0, frequency_penalty=0.5)
    outputs = [[0, 0, 1]] * 20000
    tokens = Sampler(5).sample(LOGITS.expand(20000, -1).clone(), batch_of([params] * 20000, outputs=outputs)).tokens
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    want = LOGITS.clone()
    want[7] += 4.0
    want[0] -= 1.0 + 2 * 0.5
    want[1] -= 1.0 + 0.5
    assert chi_square(counts, torch.softmax(want, dim=-1).double()) < 30
    assert chi_square(counts, torch.softmax(LOGITS, dim=-1).double()) > 100


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=99, repetition_penalty=1.2)
    others = [SamplingParams(), SamplingParams(temperature=1.5, top_p=0.5), SamplingParams(temperature=0.3, seed=1)]
    history = [[1, 2, 3]]

    def run(rows: list[int], params: list[SamplingParams], step_count: int = 5) -> list[int]:
        sampler = Sampler(0)
        seen = []
        batch = SamplingBatch(params, [[4]] * len(rows), history * len(rows), [()] * len(rows), list(range(len(rows))))
        for _ in range(step_count):
            tokens = sampler.sample(logits[rows].clone(), batch).tokens
            seen.append(tokens[params.index(seeded)])
        return seen

    alone = run([0], [seeded])
    assert run([3, 0, 4], [others[0], seeded, others[1]]) == alone
    assert run([5, 1, 2, 0], [others[2], others[1], others[0], seeded]) == alone
    assert len(set(alone)) > 1  # it really samples


def test_greedy_rows_are_the_exact_argmax_after_bias_and_penalties():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 30, generator=gen)
    params = [SamplingParams(), SamplingParams(logit_bias={5: 50.0}), SamplingParams(repetition_penalty=100.0)]
    top = int(logits[2].argmax())
    batch = SamplingBatch(params, [[1], [1], [top]], [[], [], []], [(), (), ()], [0, 1, 2])
    tokens = Sampler().sample(logits.clone(), batch).tokens
    assert tokens[0] == int(logits[0].argmax()) and tokens[1] == 5
    assert tokens[2] != top and tokens[2] == int(logits[2].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())


def test_penalties_change_generation_and_stay_reproducible(tiny_llama):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=128, block_size=8)
    plain = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    no_repeats = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1e4, frequency_penalty=2)
    penalized = llm.generate([[3, 4, 5]], no_repeats)[0].token_ids
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself greedily ...
    assert len(set(penalized)) == len(penalized) and not set(penalized) & {3, 4, 5}  # ... not when penalized
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=4, min_p=0.01, presence_penalty=1.0)
    alone = llm.generate([[3, 4, 5]], sampled)[0].token_ids
    crowd = llm.generate([[9, 9], [3, 4, 5]], [SamplingParams(max_tokens=3), sampled])[1].token_ids
    assert crowd == alone
