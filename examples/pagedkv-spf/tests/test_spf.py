"""The installed plugin: found through its entry point, it reorders admission and keeps the invariants."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.testing import tiny_llama

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
LENGTHS = [30, 5, 17, 5, 9]  # request i has a prompt of LENGTHS[i] tokens


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def prompts(lengths):
    return [[1 + (7 * i + j) % 200 for j in range(n)] for i, n in enumerate(lengths)]


def run(engine, lengths):
    """Returns (request ids in order of completion, their token ids), checking invariants every step."""
    for i, prompt in enumerate(prompts(lengths)):
        engine.add_request(prompt, PARAMS, request_id=str(i))
    order, tokens = [], {}
    while engine.has_unfinished():
        for out in engine.step(stream=False):
            order.append(int(out.request_id))
            tokens[int(out.request_id)] = out.outputs[0].token_ids
        engine.check_invariants()
    assert engine.pool.num_free == engine.num_blocks
    return order, tokens


def test_installed_through_the_entry_point():
    eps = {ep.name: ep for ep in entry_points(group="pagedkv")}
    assert "spf" in eps, "pagedkv-spf is not installed: pip install -e examples/pagedkv-spf"
    assert eps["spf"].value == "pagedkv_spf"


def test_one_at_a_time_the_shortest_prompt_goes_first(model):
    fcfs = run(Engine(EngineConfig(device="cpu", num_blocks=64, block_size=8, max_num_seqs=1), model=model), LENGTHS)
    spf = run(Engine(EngineConfig(device="cpu", num_blocks=64, block_size=8, max_num_seqs=1, scheduler="spf"),
                     model=model), LENGTHS)
    assert fcfs[0] == [0, 1, 2, 3, 4]
    assert spf[0] == [1, 3, 4, 2, 0]  # by length, ties in arrival order
    assert spf[1] == fcfs[1]  # the same tokens, only the order differs


def test_preemption_under_memory_pressure_keeps_outputs_and_blocks(model):
    lengths = [20, 14, 3, 22, 6, 11]
    config = dict(device="cpu", num_blocks=8, block_size=4, max_num_batched_tokens=16)
    fcfs = run(Engine(EngineConfig(**config), model=model), lengths)
    engine = Engine(EngineConfig(**config, scheduler="spf"), model=model)
    spf = run(engine, lengths)
    assert engine.stats.preemptions > 0, "the test should exercise preemption"
    assert spf[1] == fcfs[1]
