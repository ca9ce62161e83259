"""Each batched logits processor equals transformers' processor (or a plain Python reference) row by row."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pagedkv import SamplingParams
from pagedkv.core.sample.logits_processors import (
    add_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    ban_tokens,
)

VOCAB = 40


def random_logits(rows: int, seed: int) -> torch.Tensor:
    """Fresh logits with ties (rounded) and a spread wide enough for the filters to cut."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 3).round(decimals=1)


def hf(processor, row: torch.Tensor, input_ids: list[int] | None = None) -> torch.Tensor:
    ids = torch.tensor([input_ids or [0]])
    return processor(ids, row.unsqueeze(0).clone())[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_temperature_matches_transformers(seed):
    logits = random_logits(5, seed)
    temps = [0.01, 0.3, 0.7, 1.0, 2.5]
    ours = apply_temperature(logits.clone(), torch.tensor(temps))
    for row, t in enumerate(temps):
        assert torch.equal(ours[row], hf(TemperatureLogitsWarper(t), logits[row]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_matches_transformers_and_keeps_ties(seed):
    logits = random_logits(6, seed)
    logits[1, :3] = logits[1].max() + 1  # a three-way tie at the top: top_k=2 keeps all three
    ks = [1, 2, 5, VOCAB - 1, 0, VOCAB + 7]  # 0 and >= vocab are off
    ours = apply_top_k_top_p(logits.clone(), ks, [1.0] * 6)
    for row, k in enumerate(ks):
        want = hf(TopKLogitsWarper(k), logits[row]) if 0 < k else logits[row]
        assert torch.equal(ours[row], want), row
    assert int(torch.isfinite(ours[1]).sum()) == 3
    assert int(torch.isfinite(ours[2]).sum()) >= 5 and not torch.isfinite(ours[2]).all()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_top_p_matches_transformers(seed):
    logits = random_logits(6, seed)
    ps = [0.05, 0.3, 0.5, 0.7, 0.95, 1.0]
    ours = apply_top_k_top_p(logits.clone(), [0] * 6, ps)
    dropped = 0
    for row, p in enumerate(ps):
        want = hf(TopPLogitsWarper(p), logits[row]) if p < 1 else logits[row]
        assert torch.equal(ours[row], want), row
        dropped += int((~torch.isfinite(ours[row])).sum())
    assert dropped > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_then_top_p_matches_transformers_chain(seed):
    logits = random_logits(4, seed)
    ks, ps = [3, 10, 0, 25], [0.9, 0.6, 0.8, 1.0]
    ours = apply_top_k_top_p(logits.clone(), ks, ps)
    for row in range(4):
        want = logits[row]
        if ks[row]:
            want = hf(TopKLogitsWarper(ks[row]), want)
        if ps[row] < 1:
            want = hf(TopPLogitsWarper(ps[row]), want)
        assert torch.equal(ours[row], want), row


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_top_p", [False, True])
def test_small_top_k_fast_path_matches_transformers_chain(seed, with_top_p):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(5, 1000, generator=gen) * 3).round(decimals=2)
    logits[2, 10:14] = logits[2].max() + 1  # a four-way tie at the top of a top_k=2 row
    ks, ps = [5, 50, 2, 100, 1], ([0.9, 0.5, 0.99, 0.3, 0.7] if with_top_p else [1.0] * 5)
    ours = apply_top_k_top_p(logits.clone(), ks, ps)
    for row in range(5):
        want = hf(TopKLogitsWarper(ks[row]), logits[row])
        if ps[row] < 1:
            want = hf(TopPLogitsWarper(ps[row]), want)
        assert torch.equal(ours[row], want), row
    assert int(torch.isfinite(ours[2]).sum()) == 4


def test_a_tie_past_the_largest_k_falls_back_to_the_full_sort():
    logits = torch.zeros(2, 100)
    logits[0, :3] = 5.0  # top_k=2 keeps all three tied logits, beyond kmax=2 columns
    logits[1] = torch.linspace(-3, 3, 100)
    ours = apply_top_k_top_p(logits.clone(), [2, 2], [0.99, 0.99])
    for row in range(2):
        want = hf(TopPLogitsWarper(0.99), hf(TopKLogitsWarper(2), logits[row]))
        assert torch.equal(ours[row], want), row
    assert int(torch.isfinite(ours[0]).sum()) == 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_matches_transformers(seed):
    logits = random_logits(5, seed)
    min_ps = [0.0, 0.01, 0.1, 0.5, 1.0]
    ours = logits.clone()
    apply_min_p(ours, torch.tensor(min_ps))
    for row, m in enumerate(min_ps):
        want = hf(MinPLogitsWarper(m), logits[row]) if m > 0 else logits[row]
        assert torch.equal(ours[row], want), row
    assert not torch.isfinite(ours[3]).all()


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    logits = random_logits(4, 7)
    prompts = [[1, 2, 3], [4, 4, 5], [6], [7, 8]]
    outputs = [[3, 9, 9], [], [10, 11, 6], [12]]
    penalties = [1.3, 0.7, 2.0, 1.0]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    ours = logits.clone()
    apply_penalties(ours, params, prompts, outputs)
    for row, p in enumerate(penalties):
        history = prompts[row] + outputs[row]
        want = hf(RepetitionPenaltyLogitsProcessor(p), logits[row], history) if p != 1 else logits[row]
        assert torch.equal(ours[row], want), row
    assert not torch.equal(ours[0], logits[0])


def test_presence_and_frequency_penalties_match_a_python_reference():
    logits = random_logits(3, 8)
    prompts = [[1, 2], [5, 5], [30]]
    outputs = [[2, 2, 2, 7], [5, 9], []]
    settings = [(0.5, 0.25), (-1.0, 2.0), (1.5, -0.5)]  # (presence, frequency)
    params = [SamplingParams(presence_penalty=a, frequency_penalty=b) for a, b in settings]
    ours = logits.clone()
    apply_penalties(ours, params, prompts, outputs)
    for row, (presence, frequency) in enumerate(settings):
        want = logits[row].tolist()
        for token in set(outputs[row]):  # prompt tokens are not penalized (OpenAI / vLLM)
            want[token] -= frequency * outputs[row].count(token) + presence
        assert torch.allclose(ours[row], torch.tensor(want), atol=1e-6, rtol=0), row
    assert ours[0, 1] == logits[0, 1] and ours[0, 2] != logits[0, 2]


def test_all_penalties_together_equal_repetition_then_presence_frequency():
    logits = random_logits(2, 9)
    prompts, outputs = [[1, 2, 3], [4]], [[3, 3, 5], [4, 6]]
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)] * 2
    ours = logits.clone()
    apply_penalties(ours, params, prompts, outputs)
    for row in range(2):
        want = hf(RepetitionPenaltyLogitsProcessor(1.5), logits[row], prompts[row] + outputs[row]).tolist()
        for token in set(outputs[row]):
            want[token] -= 0.2 * outputs[row].count(token) + 0.3
        assert torch.allclose(ours[row], torch.tensor(want), atol=1e-6, rtol=0)


def test_logit_bias_matches_transformers_sequence_bias():
    logits = random_logits(3, 10)
    biases = [{3: 5.0, 7: -100.0}, {}, {0: 0.5, 39: -2.25}]
    ours = logits.clone()
    add_logit_bias(ours, biases)
    for row, bias in enumerate(biases):
        want = logits[row]
        if bias:
            want = hf(SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]), want)
        assert torch.equal(ours[row], want), row


def test_banned_tokens_match_transformers_no_bad_words():
    logits = random_logits(3, 11)
    banned = [[2, 5], (), [39]]
    ours = logits.clone()
    ban_tokens(ours, banned)
    for row, ids in enumerate(banned):
        want = hf(NoBadWordsLogitsProcessor([[t] for t in ids]), logits[row]) if ids else logits[row]
        assert torch.equal(ours[row], want), row
    assert ours[0, 2] == float("-inf")


def test_overflowing_temperature_stays_a_distribution():
    logits = torch.tensor([[3.0e38, 1.0, -3.0e38, float("nan")]])
    scaled = apply_temperature(logits, torch.tensor([0.01]))
    probs = torch.softmax(scaled, dim=-1)
    assert torch.isfinite(probs).all() and probs[0, 0] == 1
