"""The decode lane (``engine simulate``'s shortcut) decides exactly what one-by-one stepping decides.

Each check runs the same thing twice, with ``decode_lane`` on and off, and compares
everything observable: the run's figures, the blocks-in-use series, every block id
handed out and every block freed (with its owner), and, in the stateful test, the
pool, the queues and every step's outputs after every operation.
"""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import EngineConfig, SamplingParams
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.kv.allocator import PagedAllocator, StaticAllocator
from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.sched.scheduler import FCFSScheduler
from pagedkv.sim.lane_run import run_lane
from pagedkv.sim.sim_engine import SimEngine
from pagedkv.sim.simulate import SimSetup, run_once
from pagedkv.sim.simulated_runner import SimulatedRunner
from pagedkv.sim.step_time_model import StepTimeModel
from pagedkv.sim.tally import RunTally
from pagedkv.sim.workload import builtin_workload

SIM_MODEL = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            hidden_size=64, max_position_embeddings=4096, vocab_size=1000)


def sim(config, **kwargs) -> SimEngine:
    """A simulated engine (decode lane on unless ``decode_lane=False``)."""
    return SimEngine(config, runner=SimulatedRunner(SIM_MODEL), **kwargs)


@pytest.fixture
def block_log(monkeypatch):
    """Every block id the pool hands out, and every (block, owner) it takes back, in order."""
    log: list[tuple] = []
    allocate, allocate_many = BlockPool.allocate, BlockPool.allocate_many
    decref, decref_many = BlockPool.decref, BlockPool.decref_many

    def logged_allocate(self, owner=None):
        block_id = allocate(self, owner)
        log.append(("alloc", block_id))
        return block_id

    def logged_allocate_many(self, count, owner=None):
        blocks = allocate_many(self, count, owner)
        log.extend(("alloc", b) for b in blocks)
        return blocks

    def logged_decref(self, block_id, owner=None):
        log.append(("free", block_id, owner))
        decref(self, block_id, owner)

    def logged_decref_many(self, block_ids, owner=None):
        block_ids = list(block_ids)
        log.extend(("free", b, owner) for b in block_ids)
        decref_many(self, block_ids, owner)

    monkeypatch.setattr(BlockPool, "allocate", logged_allocate)
    monkeypatch.setattr(BlockPool, "allocate_many", logged_allocate_many)
    monkeypatch.setattr(BlockPool, "decref", logged_decref)
    monkeypatch.setattr(BlockPool, "decref_many", logged_decref_many)
    return log


CASES = {
    "roomy": ("sharegpt", 300, None, SimSetup(num_blocks=3000, max_num_seqs=64)),
    "preempting, small budget": ("sharegpt", 300, None,
                                 SimSetup(num_blocks=700, max_num_seqs=256, max_num_batched_tokens=512)),
    "poisson arrivals, chunked prefill": ("sharegpt", 200, 20.0,
                                          SimSetup(num_blocks=2000, max_num_seqs=32, max_num_batched_tokens=300)),
    "block size 1, budget below the batch": ("alpaca", 300, None,
                                             SimSetup(num_blocks=3000, max_num_seqs=300, block_size=1,
                                                      max_num_batched_tokens=200)),
    "static baseline": ("sharegpt", 150, None,
                        SimSetup(num_blocks=20000, max_num_seqs=256, allocator="static", max_model_len=4096)),
    "n > 1 without forking": ("alpaca", 200, None, SimSetup(num_blocks=400, max_num_seqs=48, block_size=8)),
    "prefix caching, evicting": ("shared-prefix", 300, None,
                                 SimSetup(num_blocks=900, max_num_seqs=128, enable_prefix_caching=True,
                                          max_num_batched_tokens=700)),
    "swapping instead of recomputing": ("sharegpt", 300, None,
                                        SimSetup(num_blocks=700, max_num_seqs=256, max_num_batched_tokens=512,
                                                 swap_space="200MiB")),
    "prefix caching, block size 4, preempting": ("sharegpt", 150, 30.0,
                                                 SimSetup(num_blocks=1000, max_num_seqs=128, block_size=4,
                                                          enable_prefix_caching=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_lane_run_is_the_one_by_one_run(case, block_log):
    name, n, rate, setup = CASES[case]
    workload = builtin_workload(name, n, seed=3, request_rate=rate)
    if case.startswith("n > 1"):
        workload.requests = [replace(r, n=1 + i % 3) for i, r in enumerate(workload.requests)]
    runs = []
    for lane in (False, True):
        block_log.clear()
        result = run_once(workload, replace(setup, decode_lane=lane))
        result.pop("wall_s")
        series = result.pop("series")
        runs.append((result, list(series["t"]), list(series["blocks_used"]), list(block_log)))
    assert runs[0][0]["finished"] == n
    assert runs[0][3], "the block log recorded nothing"
    one_by_one, lane = runs
    for key in one_by_one[0]:
        assert lane[0][key] == one_by_one[0][key], key
    assert lane[1:3] == one_by_one[1:3], "blocks in use over time differ"
    assert lane[3] == one_by_one[3], "block ids or their order differ"


@pytest.mark.parametrize("case", ["roomy", "preempting, small budget"])
def test_lane_carries_most_decodes_and_cases_cover_preemption(case, monkeypatch):
    """The comparisons above must exercise both paths: the lane does most decodes, and preemptions happen."""
    counts = {"lane": 0, "stepped": 0}
    execute = SimulatedRunner.execute

    def counting_execute(self, out):
        counts["lane"] += out.lane_decodes
        counts["stepped"] += len(out.scheduled)
        return execute(self, out)

    monkeypatch.setattr(SimulatedRunner, "execute", counting_execute)
    name, n, rate, setup = CASES[case]
    result = run_once(builtin_workload(name, n, seed=3, request_rate=rate), setup, series=False)
    assert counts["lane"] > 5 * counts["stepped"]
    if case.startswith("preempting"):
        assert result["preemptions"] > 50


@pytest.mark.parametrize("case", ["static baseline", "preempting, small budget", "poisson arrivals, chunked prefill"])
def test_cases_exercise_quiet_jumps_and_preemption_on_the_lane(case, monkeypatch):
    """The comparisons above must cover the event-driven paths: steps jumped over, and lane steps that preempt."""
    from pagedkv.sim.lane_scheduler import DecodeLaneScheduling

    counts = {"skipped": 0, "preempting": 0}
    skip, preempting = SimEngine.skip, DecodeLaneScheduling._step_lane_preempting

    def counting_skip(self, steps, **kwargs):
        counts["skipped"] += steps
        return skip(self, steps, **kwargs)

    def counting_preempting(self, *args):
        counts["preempting"] += 1
        return preempting(self, *args)

    monkeypatch.setattr(SimEngine, "skip", counting_skip)
    monkeypatch.setattr(DecodeLaneScheduling, "_step_lane_preempting", counting_preempting)
    name, n, rate, setup = CASES[case]
    result = run_once(builtin_workload(name, n, seed=3, request_rate=rate), setup, series=False)
    assert counts["skipped"] > (result["steps"] // 2 if case == "static baseline" else 0)
    if case.startswith("preempting"):
        assert counts["preempting"] > 10


@pytest.mark.parametrize("case", ["roomy", "preempting, small budget", "poisson arrivals, chunked prefill",
                                  "n > 1 without forking", "swapping instead of recomputing"])
def test_cases_exercise_lane_steps_with_block_crossings(case, monkeypatch):
    """The comparisons above must cover the steps ``run_lane`` takes past the engine's step: ones where
    members cross into new blocks (several at once), ones where those blocks do not fit and it preempts, and
    ones on which members finish (completed by the engine's step)."""
    crossed, preempting, finishing = [], [], []
    cross, cross_to_events = SimEngine.cross, SimEngine.cross_to_events

    def counting_cross(self, due):
        crossed.append(len(due))
        preempting.append(len(due) > self.pool.num_available)
        return cross(self, due)

    def counting_cross_to_events(self, due):
        outs = cross_to_events(self, due)
        finishing.append(sum(o.finished for o in outs))
        return outs

    monkeypatch.setattr(SimEngine, "cross", counting_cross)
    monkeypatch.setattr(SimEngine, "cross_to_events", counting_cross_to_events)
    name, n, rate, setup = CASES[case]
    workload = builtin_workload(name, n, seed=3, request_rate=rate)
    if case.startswith("n > 1"):
        workload.requests = [replace(r, n=1 + i % 3) for i, r in enumerate(workload.requests)]
    result = run_once(workload, setup, series=False)
    assert len(crossed) > result["steps"] // 10
    assert max(crossed) > 1
    assert sum(finishing) > n // 10
    if case.startswith("preempting"):
        assert sum(preempting) > 10


def test_lane_is_on_only_where_nothing_needs_every_sequence(tmp_path):
    config = EngineConfig(device="cpu", num_blocks=64, block_size=4)
    assert sim(config).lane is not None
    assert sim(config, decode_lane=False).lane is None
    assert sim(replace(config, allocator="static")).lane is not None
    assert sim(replace(config, enable_prefix_caching=True)).lane is not None
    assert sim(replace(config, swap_space="1MiB")).lane is not None  # (preempts flushed)
    # a step-event listener (telemetry, for a trace, too) sees every sequence's progress each step: no lane
    assert sim(replace(config, trace=str(tmp_path / "t.ndjson"))).lane is None

    class StepListener:  # any step-event listener
        @hookimpl
        def pagedkv_on_step_events(self, events):
            pass

    # forks share partly filled blocks; such a listener may expect every sequence's events each step
    assert sim(replace(config, enable_copy_on_write=True)).lane is None
    assert sim(config, plugins=(StepListener(),)).lane is None


def test_lane_member_materializes_when_aborted_or_streamed():
    engine = sim(EngineConfig(device="cpu", num_blocks=64, block_size=4))
    a = engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add_request([4, 5], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(10):
        engine.step(stream=False)
    seq_a, seq_b = engine.requests[a][0], engine.requests[b][0]
    assert seq_a in engine.lane.members and len(seq_a.output_token_ids) == 1  # stale while in the lane
    assert engine.abort(a)
    assert len(seq_a.output_token_ids) == 10 and seq_a.num_computed_tokens == 3 + 9
    outs = engine.step(stream=True)  # streaming: every running sequence exact again
    assert [o.request_id for o in outs] == [b] and len(outs[0].token_ids) == 11
    assert seq_b.num_computed_tokens == 2 + 10
    engine.check_invariants()


def test_blocks_go_out_in_running_order_around_an_older_sequence_outside_the_lane():
    """Block size 1: every decode needs a block every step. The oldest request has a stop id, so it is
    stepped one by one outside the lane, and must still get its block before the newer lane members."""
    config = EngineConfig(device="cpu", num_blocks=200, block_size=1, max_num_seqs=8)
    twins = [sim(config, decode_lane=False), sim(config)]
    for engine in twins:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[7]))
        for prompt in ([4, 5], [6], [8, 9, 10]):
            engine.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(12):
        for engine in twins:
            engine.step(stream=False)
    plain, laned = twins
    assert len(laned.lane.members) == 3 and len(laned.lane.outside) == 1
    assert [s.block_table.blocks for s in plain.scheduler.running] == [
        s.block_table.blocks for s in laned.scheduler.running
    ]


class _Watcher:
    """A third-party plugin that looks at sequences from hooks: what it sees must not depend on the lane."""

    def __init__(self) -> None:
        self.seen: list[tuple] = []

    @hookimpl
    def pagedkv_on_block_full(self, seq, logical_index, block_id):
        self.seen.append((seq.request_id, logical_index, block_id, seq.num_computed_tokens,
                          len(seq.output_token_ids), seq.num_tokens))

    @hookimpl
    def pagedkv_report_stats(self):
        running = self.engine.scheduler.running
        return {"watched_fills": len(self.seen), "running_outputs": sum(len(s.output_token_ids) for s in running),
                "running_computed": sum(s.num_computed_tokens for s in running)}


def test_plugins_reading_sequences_from_hooks_see_what_one_by_one_stepping_shows():
    seen, stats = [], []
    for lane in (False, True):
        watcher = _Watcher()
        engine = sim(EngineConfig(device="cpu", block_size=4, num_blocks=64),
                     plugins=(watcher,), decode_lane=lane)
        watcher.engine = engine
        assert (engine.lane is not None) == lane
        for prompt, max_tokens in (([1, 2, 3], 14), ([4] * 8, 9), ([5, 6], 30)):
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        mid = None
        for step in range(40):
            engine.step(stream=False)
            if step == 11:
                mid = engine.plugin_stats()
        seen.append(watcher.seen)
        stats.append(mid)
    assert seen[0] == seen[1] and len(seen[0]) > 10
    assert stats[0] == stats[1]


class _OwnBlockGrowth(PagedAllocator):
    def blocks_to_reserve(self, seq, num_tokens):
        return super().blocks_to_reserve(seq, num_tokens + 1)  # one block of headroom


class _OwnLoop(FCFSScheduler):
    def schedule(self):
        return super().schedule()


class _OnlyQueueOrder(FCFSScheduler):
    def add(self, seq):
        super().add(seq)


@pytest.mark.parametrize(("allocator", "scheduler", "lane"), [
    (PagedAllocator, FCFSScheduler, True),
    (StaticAllocator, FCFSScheduler, True),
    (_OwnBlockGrowth, FCFSScheduler, False),  # the lane would grow tables the built-in way, not this one's
    (PagedAllocator, _OwnLoop, False),  # its running loop may not know the lane
    (PagedAllocator, _OnlyQueueOrder, True),  # (like examples/pagedkv-spf: waiting order only)
])
def test_lane_only_where_it_reproduces_the_allocator_and_the_running_loop(allocator, scheduler, lane):
    class Registrar:
        @hookimpl
        def pagedkv_register_allocators(self, register):
            register("custom", allocator, "test allocator")

        @hookimpl
        def pagedkv_register_schedulers(self, register):
            register("custom", scheduler, "test scheduler")

    config = EngineConfig(device="cpu", num_blocks=64, block_size=4, allocator="custom", scheduler="custom")
    engines = [sim(config, plugins=(Registrar(),), decode_lane=on) for on in (False, True)]
    assert (engines[1].lane is not None) == lane
    for engine in engines:
        for prompt in ([1, 2, 3], [4, 5, 6, 7, 8], [9]):
            engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(20):
        outs = [[(o.request_id, o.token_ids) for o in e.step(stream=False)] for e in engines]
        assert outs[0] == outs[1]
        assert engines[0].pool.ref_counts == engines[1].pool.ref_counts


# --- stateful: two engines, lane on and off, fed the same operations --------------------------------------------


def _plugin_counters(engine) -> dict:
    merged: dict = {}
    for answer in engine.pm.hook.pagedkv_report_stats():
        merged.update(answer)
    return merged


class TwinMachine(RuleBasedStateMachine):
    prefix_caching = False
    swap_space: int | None = None

    @initialize(num_blocks=st.integers(10, 48), block_size=st.sampled_from([1, 2, 4]),
                max_num_seqs=st.integers(1, 8), budget=st.integers(1, 40), static=st.booleans())
    def build(self, num_blocks, block_size, max_num_seqs, budget, static):
        config = EngineConfig(device="cpu", block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=budget, allocator="static" if static else "paged",
                              max_model_len=min(num_blocks * block_size, 60),
                              enable_prefix_caching=self.prefix_caching, swap_space=self.swap_space)
        self.engines = [sim(config, decode_lane=False), sim(config)]
        self.active: list[str] = []

    @rule(prefix=st.sampled_from([(), (5,) * 8, (6, 7) * 5]), tail=st.lists(st.integers(1, 999), min_size=1,
          max_size=25), n=st.integers(1, 2), max_tokens=st.integers(1, 30),
          stop=st.sampled_from([(), (), (), (0,), (7,)]))
    def add(self, prefix, tail, n, max_tokens, stop):
        prompt = [*prefix, *tail]  # shared prefixes give the prefix cache something to hit
        # a stop id keeps a sequence out of the lane: (0,) ends it at its first token, (7,) never fires,
        # so it stays outside, stepped one by one among lane members
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop))
        limit = self.engines[0].max_model_len
        if len(prompt) > limit:
            prompt = prompt[:limit]
        ids = [engine.add_request(prompt, params) for engine in self.engines]
        assert ids[0] == ids[1]
        self.active.append(ids[0])

    @precondition(lambda self: self.engines[0].has_unfinished())
    @rule(times=st.integers(1, 12), stream=st.booleans())
    def step(self, times, stream):
        for _ in range(times):
            if not self.engines[0].has_unfinished():
                break
            outs = [[(o.request_id, o.finished, o.token_ids) for o in e.step(stream=stream)] for e in self.engines]
            assert outs[0] == outs[1]
            for request_id, finished, _ in outs[0]:
                if finished:
                    self.active.remove(request_id)

    @precondition(lambda self: self.active)
    @rule(which=st.integers(0, 10**6))
    def abort(self, which):
        request_id = self.active.pop(which % len(self.active))
        assert all(engine.abort(request_id) for engine in self.engines)

    @precondition(lambda self: self.engines[0].has_unfinished())
    @rule()
    def run_the_lane(self):
        """The steps ``run_lane`` takes past the engine's step are what as many one-by-one steps do."""
        plain, laned = self.engines
        tally = RunTally(StepTimeModel(1e-3, 1e-5, 1e-4, 1e-7), laned.config.block_size, {}, False, None, 0)
        run_lane(laned, tally, None, None)
        finished = []
        for _ in range(tally.step):
            finished += [o.request_id for o in plain.step(stream=False) if o.finished]
        assert finished == list(tally.finished)
        for request_id in finished:
            self.active.remove(request_id)

    @rule(budget=st.integers(1, 40))
    def change_token_budget(self, budget):
        for engine in self.engines:
            engine.scheduler.max_num_batched_tokens = budget

    @invariant()
    def twins_agree(self):
        plain, laned = self.engines
        assert plain.pool.ref_counts == laned.pool.ref_counts
        assert list(plain.pool.free_queue) == list(laned.pool.free_queue)
        for queue in ("running", "waiting", "swapped"):
            ids = [[s.request_id for s in getattr(e.scheduler, queue)] for e in self.engines]
            assert ids[0] == ids[1], queue
        assert [s.block_table.blocks for s in plain.scheduler.running] == [
            s.block_table.blocks for s in laned.scheduler.running
        ]
        assert vars(plain.stats) == vars(laned.stats)
        assert plain.pool.cached_blocks() == laned.pool.cached_blocks()
        assert _plugin_counters(plain) == _plugin_counters(laned)  # (plugin_stats() would flush the lane)
        assert plain.tokens_held() == laned.tokens_held()
        lane = laned.lane
        assert not set(lane.members) & set(lane.outside)
        assert set(lane.members) | set(lane.outside) == set(laned.scheduler.running)
        assert lane.tokens() + sum(s.num_computed_tokens for s in lane.outside) == sum(
            s.num_computed_tokens for s in plain.scheduler.running
        )

    def teardown(self):
        engines = getattr(self, "engines", None)
        if engines is None:
            return
        for request_id in list(self.active):
            for engine in engines:
                engine.abort(request_id)
        for engine in engines:
            assert not engine.has_unfinished()
            engine.check_invariants()
            assert engine.pool.num_available == engine.num_blocks


class PrefixCachingTwinMachine(TwinMachine):
    prefix_caching = True  # the lane then reports full blocks and allocates through the plugin's hooks


class SwapTwinMachine(TwinMachine):
    prefix_caching = True
    swap_space = 24 * 2 * 2 * 4 * 2 * 16 * 4  # ~24 CPU blocks of block size 4 (fewer at larger sizes)


TWIN_SETTINGS = settings(
    max_examples=int(os.environ.get("PAGEDKV_STATE_EXAMPLES", "40")),
    stateful_step_count=150,
    derandomize=True,
    deadline=None,
    database=None,
)
TwinMachine.TestCase.settings = TWIN_SETTINGS
PrefixCachingTwinMachine.TestCase.settings = TWIN_SETTINGS
SwapTwinMachine.TestCase.settings = TWIN_SETTINGS
test_lane_and_one_by_one_engines_stay_identical = TwinMachine.TestCase
test_with_prefix_caching_lane_and_one_by_one_engines_stay_identical = PrefixCachingTwinMachine.TestCase
test_with_swap_and_prefix_caching_lane_and_one_by_one_engines_stay_identical = SwapTwinMachine.TestCase
