"""Reliability: plugin faults stay contained, aborts free exactly their references, pressure never hangs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from conftest import drain, hf_greedy, random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core.hookspecs import hookimpl
from pagedkv.sim.simulated_runner import SimulatedRunner

SIM_MODEL = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            hidden_size=64, max_position_embeddings=4096, vocab_size=1000)


def all_blocks_back(engine):
    assert engine.pool.num_available == engine.num_blocks


class BrokenObserver:
    @hookimpl
    def pagedkv_on_step_events(self, events):
        raise RuntimeError("observer bug")


class BrokenPrefixMatch:
    """Fails the decision only for prompts that start with token 7."""

    @hookimpl
    def pagedkv_match_prefix(self, seq, allocator):
        if seq.prompt_token_ids[0] == 7:
            raise ValueError("match bug")
        return None


def test_observer_that_raises_is_disabled_and_the_run_goes_on(tiny_llama, caplog):
    prompts = random_prompts([6, 11], seed=40)
    expected = [hf_greedy(tiny_llama, p, 8) for p in prompts]
    broken = BrokenObserver()
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4), model=tiny_llama, plugins=(broken,))
    ids = [engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    with caplog.at_level(logging.ERROR, logger="pagedkv"):
        results, _ = drain(engine)
    assert [results[i].token_ids for i in ids] == expected
    assert not engine.pm.is_registered(broken)
    assert "raised in pagedkv_on_step_events and is disabled" in caplog.text
    all_blocks_back(engine)


def test_decision_hook_that_raises_fails_only_its_request(tiny_llama):
    good = random_prompts([9, 5], seed=41)
    bad = [7, *random_prompts([6], seed=42)[0]]
    expected = [hf_greedy(tiny_llama, p, 8) for p in good]
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4), model=tiny_llama,
                    plugins=(BrokenPrefixMatch(),))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in (good[0], bad, good[1])]
    results, _ = drain(engine)
    failed = results[ids[1]].outputs[0]
    assert failed.finish_reason == "error" and "pagedkv_match_prefix failed: ValueError: match bug" in failed.error
    assert [results[ids[0]].token_ids, results[ids[2]].token_ids] == expected
    assert engine.stats.failed == 1
    all_blocks_back(engine)


def test_copy_on_write_fault_fails_only_the_forked_request(tiny_llama):
    class BrokenCow:
        @hookimpl
        def pagedkv_fork_after_prefill(self, params):
            return True

        @hookimpl
        def pagedkv_copy_on_write(self, seq, logical_index, allocator):
            raise RuntimeError("cow bug")

    prompt = random_prompts([6], seed=43)[0]
    expected = hf_greedy(tiny_llama, prompt, 6)
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4), model=tiny_llama, plugins=(BrokenCow(),))
    forked = engine.add_request(random_prompts([5], seed=44)[0],
                                SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=1, ignore_eos=True))
    plain = engine.add_request(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    results, _ = drain(engine)
    assert results[plain].token_ids == expected
    assert any(c.finish_reason == "error" and "cow bug" in c.error for c in results[forked].outputs)
    all_blocks_back(engine)


@pytest.mark.parametrize("moment", ["mid_prefill", "mid_decode", "while_sharing", "while_swapped", "while_waiting"])
def test_abort_frees_exactly_the_request_references(moment):
    config = EngineConfig(device="cpu", num_blocks=24, block_size=4, max_num_batched_tokens=8,
                          enable_copy_on_write=True, enable_prefix_caching=True, swap_space="1MiB")
    engine = Engine(config, runner=SimulatedRunner(SIM_MODEL))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    shared = engine.add_request(list(range(1, 11)), SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=2,
                                                                    ignore_eos=True))
    others = [engine.add_request(list(range(50 + i, 70 + i)), params) for i in range(3)]
    target = {"mid_prefill": others[0], "while_sharing": shared, "while_waiting": others[2]}.get(moment)
    for _ in range(200):
        engine.step()
        engine.check_invariants()
        seqs = {s.request_id: s for q in (engine.scheduler.running, engine.scheduler.waiting,
                                         engine.scheduler.swapped) for s in q}
        if moment == "mid_prefill" and 0 < seqs[target].num_computed_tokens < 20:
            break
        decoding = [s.request_id for s in engine.scheduler.running if s.output_token_ids and s.request_id != shared]
        if moment == "mid_decode" and decoding:
            target = decoding[0]
            break
        if moment == "while_sharing" and any(engine.pool.ref_counts[b] > 1 for s in engine.scheduler.running
                                             for b in s.block_table):
            break
        if moment == "while_swapped" and engine.scheduler.swapped:
            target = engine.scheduler.swapped[0].request_id
            break
        if moment == "while_waiting" and seqs.get(target) in engine.scheduler.waiting:
            break
    else:
        pytest.fail(f"never reached the moment {moment}")
    refs_before = list(engine.pool.ref_counts)
    held = [b for q in (engine.scheduler.running, engine.scheduler.waiting) for s in q if s.request_id == target
            for b in s.block_table]
    assert engine.abort(target)
    engine.check_invariants()
    for block_id, refs in enumerate(engine.pool.ref_counts):
        assert refs == refs_before[block_id] - held.count(block_id)
    drain(engine)
    all_blocks_back(engine)
    swap = engine.pm.get_plugin("cpu_swap.instance")
    assert swap.cpu_pool.num_free == swap.cpu_pool.num_blocks


def test_many_long_requests_against_a_tiny_pool_all_finish_in_bounded_steps():
    engine = Engine(EngineConfig(device="cpu", num_blocks=16, block_size=4, max_num_batched_tokens=16),
                    runner=SimulatedRunner(SIM_MODEL))
    ids = [engine.add_request([1 + i] * (20 + i % 7), SamplingParams(max_tokens=40, ignore_eos=True))
           for i in range(30)]
    results, steps = drain(engine, limit=20_000)
    assert set(results) == set(ids)
    # the pool holds 64 tokens, so max_model_len is 64: a prompt of p tokens gets min(40, 64 - p) tokens
    assert engine.max_model_len == 64
    for i, request_id in enumerate(ids):
        out = results[request_id].outputs[0]
        assert (len(out.token_ids), out.finish_reason) == (min(40, 64 - (20 + i % 7)), "length")
    assert engine.stats.preemptions > 0
    all_blocks_back(engine)


def test_preempt_resume_ping_pong_between_two_requests_terminates():
    # two requests that each need almost the whole pool keep evicting each other
    engine = Engine(EngineConfig(device="cpu", num_blocks=10, block_size=4), runner=SimulatedRunner(SIM_MODEL))
    a = engine.add_request([1] * 18, SamplingParams(max_tokens=20, ignore_eos=True))
    b = engine.add_request([2] * 18, SamplingParams(max_tokens=20, ignore_eos=True))
    results, steps = drain(engine, limit=2000)
    assert set(results) == {a, b}
    assert engine.stats.preemptions >= 1
    all_blocks_back(engine)


def test_static_allocator_reserves_up_front_so_it_never_preempts_even_with_swap_space():
    engine = Engine(EngineConfig(device="cpu", num_blocks=12, block_size=4, max_model_len=16, allocator="static",
                                 swap_space="1MiB"), runner=SimulatedRunner(SIM_MODEL))
    ids = [engine.add_request([3 + i] * 6, SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(5)]
    results, _ = drain(engine)
    assert set(results) == set(ids)
    assert engine.stats.preemptions == 0 and engine.stats.peak_running == 3  # 12 blocks / 4 per request
    all_blocks_back(engine)


class _FlakyTokenizer:
    """Decodes to a fixed text, except that its first call fails (a stop-string check runs first)."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        if self.calls == 1:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return "ok " * len(ids)


def test_a_failing_stop_check_ends_only_its_request_with_an_error():
    tokenizer = _FlakyTokenizer()
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4), tokenizer=tokenizer,
                    runner=SimulatedRunner(SIM_MODEL))
    broken = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True, stop=["never"]))
    fine = engine.add_request([4, 5], SamplingParams(max_tokens=6, ignore_eos=True))
    first = {o.request_id: o for o in engine.step()}
    assert first[broken].finished and first[broken].outputs[0].finish_reason == "error"
    error = first[broken].outputs[0].error
    assert "stop check failed" in error and "UnicodeDecodeError" in error
    assert first[broken].outputs[0].token_ids == []  # the token the failed check saw was not accepted
    assert not first[fine].finished and len(first[fine].outputs[0].token_ids) == 1
    outs, _ = drain(engine)
    assert outs[fine].outputs[0].finish_reason == "length" and len(outs[fine].outputs[0].token_ids) == 6
    assert engine.stats.failed == 1 and engine.stats.generated_tokens == 6
    all_blocks_back(engine)
