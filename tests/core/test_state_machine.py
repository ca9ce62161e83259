"""Stateful property test: random add / step / abort / budget changes with prefix caching, CoW and swap.

Runs the real pool, allocator, scheduler and plugins through the simulated
runner (no model), checking every invariant after every operation. CI runs
50 x 200 = 10^4 operations, derandomized; more with PAGEDKV_STATE_EXAMPLES.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core.sched.sequence import SequenceStatus
from pagedkv.sim.simulated_runner import SimulatedRunner

SIM_MODEL = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            hidden_size=64, max_position_embeddings=4096, vocab_size=1000)
PREFIXES = [[5] * 12, [6] * 9, [7, 8] * 4]
BLOCK = 4


class EngineMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(12, 40), swap_blocks=st.integers(0, 12))
    def build(self, num_blocks, swap_blocks):
        config = EngineConfig(
            device="cpu", block_size=BLOCK, num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=24,
            enable_prefix_caching=True, enable_copy_on_write=True, swap_space=swap_blocks * 2 * 2 * BLOCK * 2 * 16 * 4,
        )
        self.engine = Engine(config, runner=SimulatedRunner(SIM_MODEL))
        self.active: list[str] = []

    @rule(prefix=st.integers(-1, len(PREFIXES) - 1), tail=st.lists(st.integers(1, 999), min_size=1, max_size=30),
          n=st.integers(1, 3), max_tokens=st.integers(1, 25), salt=st.sampled_from([None, None, "tenant"]))
    def add(self, prefix, tail, n, max_tokens, salt):
        prompt = (PREFIXES[prefix] if prefix >= 0 else []) + tail
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0 if n > 1 else 0.0, seed=1,
                                ignore_eos=True)
        self.active.append(self.engine.add_request(prompt, params, cache_salt=salt))

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            if not self.engine.has_unfinished():
                break
            for out in self.engine.step():
                if out.finished:
                    self.active.remove(out.request_id)

    @precondition(lambda self: self.active)
    @rule(which=st.integers(0, 10**6))
    def abort(self, which):
        request_id = self.active.pop(which % len(self.active))
        assert self.engine.abort(request_id)

    @rule(budget=st.integers(1, 32))
    def change_token_budget(self, budget):
        self.engine.scheduler.max_num_batched_tokens = budget

    @invariant()
    def blocks_are_consistent(self):
        engine = self.engine
        engine.check_invariants()
        cache = engine.pm.get_plugin("prefix_cache.instance")
        cache.check(engine.pool)
        for seq in engine.scheduler.running:  # a cached block holds exactly the tokens its tables say
            tokens = seq.token_ids
            for i, block_id in enumerate(seq.block_table):
                info = cache.block_info.get(block_id)
                if info is not None and (i + 1) * BLOCK <= seq.num_computed_tokens:
                    assert info[1] == tuple(tokens[i * BLOCK : (i + 1) * BLOCK])
                    assert info[0] == list(cache._chunks(seq, i + 1))[-1][0], "key is not the prefix's hash chain"
        swap = engine.pm.get_plugin("cpu_swap.instance")  # None when the machine drew no swap space
        if swap is not None and swap.cpu_pool is not None:
            swap.cpu_pool.check()
            held = sum(len(v) for v in swap.tables.values())
            assert swap.cpu_pool.num_free + held == swap.cpu_pool.num_blocks
            assert {s.seq_id for s in engine.scheduler.swapped} == set(swap.tables)
        for seq in engine.scheduler.swapped:
            assert seq.status is SequenceStatus.SWAPPED and seq not in engine.scheduler.running
        fill: dict[int, int] = {}  # tokens held, the slow way: every block of every running table
        for seq in engine.scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                held = min(BLOCK, max(0, seq.num_computed_tokens - i * BLOCK))
                fill[block_id] = max(fill.get(block_id, 0), held)
        assert engine.tokens_held() == sum(fill.values())

    def teardown(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        for request_id in list(self.active):
            engine.abort(request_id)
        assert not engine.has_unfinished()
        engine.check_invariants()
        assert engine.pool.num_available == engine.num_blocks
        swap = engine.pm.get_plugin("cpu_swap.instance")
        if swap is not None and swap.cpu_pool is not None:
            assert swap.cpu_pool.num_free == swap.cpu_pool.num_blocks


EngineMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("PAGEDKV_STATE_EXAMPLES", "50")),
    stateful_step_count=200,
    derandomize=True,
    deadline=None,
    database=None,
)
test_engine_state_machine = EngineMachine.TestCase
