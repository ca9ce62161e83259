"""The priority scheduler's aging, its eviction candidates, and the priority bound on the Python API."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import _tiny_llama
from pagedkv import LLM, Engine, EngineConfig, SamplingParams
from pagedkv.core.errors import ConfigError, RequestRejected
from pagedkv.core.kv.allocator import PagedAllocator
from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.sched.priority_scheduler import PriorityScheduler
from pagedkv.core.sched.sequence import Sequence


def make(**limits):
    config = SimpleNamespace(max_num_seqs=1, max_num_batched_tokens=64, **limits)
    return PriorityScheduler(config, PagedAllocator(BlockPool(100), 4))


def seq(rid: str, priority: int) -> Sequence:
    s = Sequence(rid, [1, 2, 3], SamplingParams(), max_len=1000)
    s.priority = priority
    return s


def steps_until_served(sched: PriorityScheduler, victim: Sequence, newcomer_priority: int, limit: int) -> int | None:
    """One newcomer of ``newcomer_priority`` arrives every step and whatever runs finishes at once (one
    slot): the step at which ``victim`` ran, or None if the stream starved it for ``limit`` steps."""
    sched.add(victim)
    for step in range(limit):
        sched.add(seq(f"new-{step}", newcomer_priority))
        out = sched.schedule()
        for item in out.scheduled:
            if item.seq is victim:
                return step
            sched.finish(item.seq, "stop")
    return None


def test_a_stream_of_better_priority_requests_does_not_starve_a_waiting_one():
    # the default: 100 steps of waiting are worth one level, so priority 5 runs after ~500 steps of priority 0
    served = steps_until_served(make(), seq("patient", 5), 0, 2000)
    assert served is not None and 490 <= served <= 510


def test_aging_steps_sets_the_rate_and_zero_is_strict_priority():
    # (5 - 1) levels x 8 steps
    assert 30 <= steps_until_served(make(priority_aging_steps=8), seq("patient", 5), 1, 1000) <= 34
    assert steps_until_served(make(priority_aging_steps=0), seq("patient", 5), 1, 1000) is None  # vLLM's


def test_aging_keeps_priority_order_among_requests_that_arrived_together():
    sched = make()
    for rid, priority in (("c", 3), ("a", -2), ("b", 0), ("a2", -2)):
        sched.add(seq(rid, priority))
    assert [s.request_id for s in sched.waiting] == ["a", "a2", "b", "c"]


def test_eviction_candidates_are_strictly_worse_never_started_worst_and_newest_first():
    sched = make()
    old, new, equal, started = seq("old-10", 10), seq("new-10", 10), seq("equal", 0), seq("started", 20)
    for s in (old, new, equal, started):
        sched.add(s)
    started.num_preemptions = 1  # it ran once (preempted by recompute): its client has seen output
    assert sched.eviction_candidates(0) == [new, old]
    assert sched.eviction_candidates(10) == [] and make().eviction_candidates(-5) == []


@pytest.fixture(scope="module")
def model():
    return _tiny_llama()


def test_the_python_api_bounds_priority_to_64_bits_and_refuses_bools(model):
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4, scheduler="priority"), model=model)
    for bad in (-10**4000, 2**63, -2**63 - 1, True, 1.0, "1"):
        with pytest.raises(RequestRejected, match="priority") as info:
            engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), priority=bad)
        assert len(str(info.value)) < 200  # never the thousand-digit number itself
    assert not engine.has_unfinished()
    for fine in (-2**63, 2**63 - 1):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), priority=fine)
    assert len(engine.scheduler.waiting) == 2


def test_llm_generate_takes_one_checked_priority_per_prompt_before_any_runs(model):
    llm = LLM(hf_model=model, device="cpu", num_blocks=32, block_size=4, scheduler="priority", max_num_seqs=1)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for bad in ([0, -10**30], [0, False], [0], 3):
        with pytest.raises(RequestRejected, match="priority"):
            llm.generate([[1, 2, 3], [4, 5, 6]], params, priority=bad)
        assert not llm.engine.has_unfinished()
    outs = llm.generate([[1, 2, 3], [4, 5, 6]], params, priority=[5, -5])
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs) and all(o.outputs for o in outs)
    fcfs = LLM(hf_model=model, device="cpu", num_blocks=32, block_size=4)
    with pytest.raises(RequestRejected, match="priority scheduling"):
        fcfs.generate([[1, 2, 3], [4, 5, 6]], params, priority=[0, 1])
    assert not fcfs.engine.has_unfinished()


def test_priority_aging_steps_is_checked_by_the_config():
    for bad in (-1, True, 1.5, 2**40):
        with pytest.raises(ConfigError, match="priority_aging_steps"):
            EngineConfig(device="cpu", num_blocks=8, priority_aging_steps=bad)
