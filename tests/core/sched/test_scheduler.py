"""FCFS continuous batching: token budget, chunked prefill, preemption of the newest."""

from __future__ import annotations

from types import SimpleNamespace

from pagedkv.core.kv.allocator import PagedAllocator
from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sched.scheduler import FCFSScheduler
from pagedkv.core.sched.sequence import Sequence, SequenceStatus


def make(num_blocks=100, block_size=4, max_num_seqs=8, budget=64):
    pool = BlockPool(num_blocks)
    alloc = PagedAllocator(pool, block_size)
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    return FCFSScheduler(config, alloc), pool


def add(sched, rid, n):
    s = Sequence(rid, list(range(1, n + 1)), SamplingParams(), max_len=10_000)
    sched.add(s)
    return s


def run_step(sched, new_token=5):
    """Pretend the model ran: advance computed tokens, sample one for each finished prefill."""
    out = sched.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.samples:
            item.seq.output_token_ids.append(new_token)
    return out


def test_prefill_and_decodes_share_a_step_within_the_token_budget():
    sched, _ = make(budget=10)
    a = add(sched, "a", 4)
    run_step(sched)
    b = add(sched, "b", 20)
    out = run_step(sched)
    tokens = {item.seq.request_id: item.num_new_tokens for item in out.scheduled}
    assert tokens == {"a": 1, "b": 9}  # a decodes, b gets the rest of the budget as a chunk
    assert out.num_batched_tokens == 10
    assert not [i for i in out.scheduled if i.seq is b][0].samples
    assert a.status is SequenceStatus.RUNNING


def test_long_prompt_is_prefilled_in_chunks():
    sched, _ = make(budget=8)
    s = add(sched, "a", 20)
    chunks = [run_step(sched).scheduled[0].num_new_tokens for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert s.output_token_ids == [5]


def test_waiting_requests_are_admitted_in_arrival_order():
    sched, _ = make(max_num_seqs=2)
    for rid in "abc":
        add(sched, rid, 3)
    out = run_step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_newest_running_sequence_is_preempted_when_blocks_run_out():
    sched, pool = make(num_blocks=4, block_size=2)
    a = add(sched, "a", 4)  # 2 blocks
    b = add(sched, "b", 4)  # 2 blocks
    run_step(sched)
    assert pool.num_free == 0
    out = run_step(sched)  # a needs a 3rd block for token 5: b must go
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table.blocks
    assert sched.waiting[0] is b
    assert [i.seq for i in out.scheduled] == [a]
    assert sched.preemptions[0].tokens_discarded == 4


def test_a_lone_sequence_that_cannot_grow_preempts_itself_and_nothing_is_scheduled():
    sched, pool = make(num_blocks=2, block_size=2)
    a = add(sched, "a", 4)
    run_step(sched)
    out = run_step(sched)
    assert out.preempted == [a] and not out.scheduled
    assert pool.num_free == 2


def test_admission_keeps_a_watermark_of_free_blocks_for_running_sequences():
    sched, pool = make(num_blocks=200, block_size=4, budget=1000)  # watermark: 1% = 2 blocks
    assert sched.watermark_blocks == 2
    add(sched, "a", 4 * 190)  # 190 blocks
    run_step(sched)
    add(sched, "b", 4 * 9)  # would leave 1 free block: below the watermark, so it waits
    out = run_step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_a_request_needing_the_whole_pool_is_still_admitted_when_nothing_runs():
    sched, pool = make(num_blocks=200, block_size=4, budget=1000)
    add(sched, "a", 4 * 200)
    out = run_step(sched)
    assert [i.seq.request_id for i in out.scheduled] == ["a"] and pool.num_free == 0
