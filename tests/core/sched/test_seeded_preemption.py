"""Seeded samples are the same whatever shares their steps: with and without recompute preemption under
copy-on-write, and row by row in the top-k / top-p filter (whose tie handling once depended on the batch)."""

from __future__ import annotations

import pytest
import torch

from conftest import _tiny_llama, random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core.sample.logits_processors import apply_top_k_top_p

# bfloat16 logits tie often; top_k with top_p is where a tie's order decided which token top-p dropped
PARAMS = {"n": 4, "max_tokens": 32, "temperature": 1.0, "top_k": 20, "top_p": 0.9}


def seeded_samples(model, num_blocks: int) -> tuple[dict[str, list[list[int]]], int]:
    engine = Engine(EngineConfig(device="cpu", block_size=4, num_blocks=num_blocks, enable_copy_on_write=True,
                                 dtype="bfloat16"), model=model)
    for i, prompt in enumerate(random_prompts([5 + 3 * i for i in range(8)], seed=7)):
        engine.add_request(prompt, SamplingParams(seed=100 + i, **PARAMS), request_id=str(i))
    samples = {}
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            samples[out.request_id] = [c.token_ids for c in out.outputs]
    assert engine.pool.num_available == engine.num_blocks
    return samples, len(engine.scheduler.preemptions)


def test_seeded_samples_are_identical_with_and_without_recompute_preemption_under_copy_on_write():
    model = _tiny_llama()
    calm, calm_preemptions = seeded_samples(model, 2048)
    pressed, preemptions = seeded_samples(model, 48)
    assert calm_preemptions == 0 and preemptions >= 20  # the tiny pool forced recompute preemption
    diverged = [(rid, i) for rid in calm for i in range(4) if calm[rid][i] != pressed[rid][i]]
    assert not diverged, f"{len(diverged)} of 32 seeded samples diverged under preemption: {diverged}"


@pytest.mark.parametrize("ks, ps", [([2, 2, 2], [0.9, 0.9, 0.9]), ([2, 5, 0], [0.9, 0.5, 0.8]),
                                    ([3, 2, 3], [1.0, 0.7, 0.7])])
def test_each_row_of_top_k_top_p_is_what_it_would_be_alone(ks, ps):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 400, generator=gen) * 2).to(torch.bfloat16).float()  # many ties, as bf16 gives
    logits[1, :4] = logits[1].max() + 1  # a tie at the k-th value that reaches past k columns
    batch = apply_top_k_top_p(logits.clone(), ks, ps)
    for row in range(3):
        alone = apply_top_k_top_p(logits[row : row + 1].clone(), [ks[row]], [ps[row]])
        assert torch.equal(batch[row], alone[0]), row
