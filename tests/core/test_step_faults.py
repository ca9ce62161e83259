"""Issue 16, item 1: a step is transactional per request.

Whatever fails for one request inside a step (its sampling row, its generator, its prompt logprobs, its
stop check, building its output, a decision hook deciding for it) ends that request alone with
finish reason "error" and a message; every other request finishes with the tokens of a fault-free run,
the invariants hold after every step and every block comes back. Pool hooks serve no single request:
a plugin raising there is disabled and nobody fails.

Each injection point raises for the target request from its ``after``-th chance on. The same
workload runs twice on fresh engines (prefix caching, copy-on-write and CPU swap all on): without the
fault and with it.
"""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_helpers import assert_all_blocks_back

from conftest import VOCAB, random_prompts
from pagedkv import Engine, EngineConfig, SamplingParams
from pagedkv.core import step_sampling as step_sampling_module
from pagedkv.core.errors import RequestRejected
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.sample import sampler as sampler_module
from pagedkv.core.sample.sampler import Sampler
from pagedkv.core.sample.sampling_batch import SamplingBatch
from pagedkv.core.sched import sequence as sequence_module
from pagedkv.testing import tiny_engine

TARGET_SEED = 4242  # only the target request samples with seeds from here on (sample i: TARGET_SEED + i)
CONFIG = dict(num_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True, enable_copy_on_write=True, swap_space="64KiB")
PER_REQUEST = ["sampler", "generator", "prompt_logprobs", "stop_check", "detokenize",
               "match_prefix", "copy_on_write", "choose_preemption", "fork_after_prefill"]
POOL = ["block_released", "block_evicted"]
TALLY = {"examples": 0, "injected": 0, "seconds": 0.0}


class Injector:
    """Makes one injection point (``kind``) raise for the target request from its ``after``-th chance on."""

    def __init__(self, kind: str | None = None, target: str | None = None, after: int = 0) -> None:
        self.kind, self.target, self.after = kind, target, after
        self.chances = self.fired = 0
        self.adding_target = False  # pagedkv_fork_after_prefill sees params only: true while the target is added

    def hit(self, kind: str, for_target: bool = True) -> None:
        if kind != self.kind or not for_target:
            return
        self.chances += 1
        if self.chances > self.after:
            self.fired += 1
            raise RuntimeError(f"injected {kind} fault")

    # tryfirst: these run before the built-in plugins and, answering None, leave the decision to them
    @hookimpl(tryfirst=True)
    def pagedkv_match_prefix(self, seq, allocator):
        self.hit("match_prefix", seq.request_id == self.target)

    @hookimpl(tryfirst=True)
    def pagedkv_copy_on_write(self, seq, logical_index, allocator):
        self.hit("copy_on_write", seq.request_id == self.target)

    @hookimpl(tryfirst=True)
    def pagedkv_choose_preemption(self, seq, scheduler):
        self.hit("choose_preemption", seq.request_id == self.target)

    @hookimpl(tryfirst=True)
    def pagedkv_fork_after_prefill(self, params):
        self.hit("fork_after_prefill", self.adding_target)

    @hookimpl(tryfirst=True)
    def pagedkv_on_block_released(self, block_id):
        self.hit("block_released")

    @hookimpl(tryfirst=True)
    def pagedkv_on_block_evicted(self, block_id):
        self.hit("block_evicted")


class FailingStopCheck:
    """The engine's stop check, raising for the target when the injector says so."""

    def __init__(self, inner, injector: Injector) -> None:
        self.inner, self.injector = inner, injector

    def __call__(self, seq, token):
        self.injector.hit("stop_check", seq.request_id == self.injector.target)
        return self.inner(seq, token)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def injection_points(stack: ExitStack, injector: Injector) -> None:
    """Wrap the per-request code paths that are not plugin hooks (each passes through unless told)."""
    penalties, record, output_text = (sampler_module.apply_penalties, step_sampling_module.record_prompt_logprobs,
                                      sequence_module.output_text)
    generator_for = Sampler.generator_for

    def sampler_row(logits, params, prompt_ids, output_ids):
        injector.hit("sampler", any(p.seed is not None and p.seed >= TARGET_SEED for p in params))
        return penalties(logits, params, prompt_ids, output_ids)

    def generator(self, seed, key):
        injector.hit("generator", seed is not None and seed >= TARGET_SEED)
        return generator_for(self, seed, key)

    def prompt_logprobs(scheduled, logits):
        injector.hit("prompt_logprobs", any(item.seq.request_id == injector.target for item in scheduled))
        return record(scheduled, logits)

    def detokenize(seq, tokenizer, final=False):
        injector.hit("detokenize", seq.request_id == injector.target)
        return output_text(seq, tokenizer, final)

    stack.enter_context(mock.patch.object(sampler_module, "apply_penalties", sampler_row))
    stack.enter_context(mock.patch.object(Sampler, "generator_for", generator))
    stack.enter_context(mock.patch.object(step_sampling_module, "record_prompt_logprobs", prompt_logprobs))
    stack.enter_context(mock.patch.object(sequence_module, "output_text", detokenize))


def run(model, workload, injector: Injector, **config):
    """Run ``workload`` ([(arrival step, prompt, params)]) to the end, checking invariants after every step.

    Returns ({request id: finished output}, {request id: rejection message}, engine)."""
    engine = tiny_engine(injector, model=model, **{**CONFIG, **config})
    engine.scheduler.stop_check = FailingStopCheck(engine.scheduler.stop_check, injector)
    results, rejected = {}, {}
    pending = sorted(enumerate(workload), key=lambda item: item[1][0])
    with ExitStack() as stack:
        injection_points(stack, injector)
        steps = 0
        while pending or engine.has_unfinished():
            while pending and pending[0][1][0] <= steps:
                index, (_, prompt, params) = pending.pop(0)
                request_id = f"r{index}"
                injector.adding_target = request_id == injector.target
                try:
                    engine.add_request(prompt, params, request_id=request_id)
                except RequestRejected as exc:
                    rejected[request_id] = str(exc)
                injector.adding_target = False
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
            engine.check_invariants()
            steps += 1
            assert steps < 3000, "the engine did not finish"
    assert_all_blocks_back(engine)
    return results, rejected, engine


def outcome(out):
    return [(c.token_ids, c.finish_reason) for c in out.outputs]


def check_fault_contained(model, workload, kind, target_index, after, **config) -> Injector:
    """The property: with the fault, every bystander ends as without it; the target ends with an error."""
    reference, ref_rejected, _ = run(model, workload, Injector(), **config)
    assert not ref_rejected and len(reference) == len(workload)
    target = f"r{target_index}"
    injector = Injector(kind, target, after)
    results, rejected, engine = run(model, workload, injector, **config)
    for request_id, expected in reference.items():
        if request_id == target and injector.fired and kind not in POOL:
            if kind == "fork_after_prefill":
                assert request_id not in results and "injected fork_after_prefill fault" in rejected[request_id]
                continue
            failed = [c for c in results[request_id].outputs if c.finish_reason == "error"]
            assert failed and all(f"injected {kind} fault" in c.error for c in failed), outcome(results[request_id])
            assert engine.stats.failed == len(failed)
        else:
            assert outcome(results[request_id]) == outcome(expected), request_id
    if kind in POOL:
        assert engine.stats.failed == 0 and not rejected
        assert not engine.pm.is_registered(injector) or not injector.fired  # a faulty plugin is left out
    return injector


def sampled(seed: int | None, n: int = 1, max_tokens: int = 6, **extra) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.8, top_k=40, seed=seed, max_tokens=max_tokens, ignore_eos=True, **extra)


GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SHARED = random_prompts([8], seed=60)[0]  # two full blocks of 4: a prefix for the cache


def workload_for(kind: str):
    """A small fixed workload in which ``kind``'s injection point is reached for the target (request 1)."""
    tails = random_prompts([3, 5, 2, 6], seed=61)
    target_params = sampled(TARGET_SEED, n=2 if kind in ("copy_on_write", "fork_after_prefill") else 1,
                            **({"prompt_logprobs": 2} if kind == "prompt_logprobs" else {}))
    if kind == "stop_check":
        target_params = sampled(TARGET_SEED, stop_token_ids=[VOCAB - 1])
    long_tokens = SamplingParams(max_tokens=14, ignore_eos=True)
    arrival = 1
    if kind == "choose_preemption":  # the newest running request is the one preempted
        arrival, target_params = 3, sampled(TARGET_SEED, max_tokens=14)
    return [
        (0, SHARED + tails[0], GREEDY),
        (arrival, SHARED + tails[1], target_params),  # arrives once the shared prefix is cached
        (0, tails[2] * 4, sampled(7, n=2)),  # seeded and forked
        (1, tails[3] + SHARED, long_tokens if kind == "choose_preemption" else sampled(None)),  # unseeded
        (2, SHARED + tails[3], long_tokens),
    ]


# --- one test per injection point ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", PER_REQUEST)
def test_a_fault_for_one_request_ends_it_alone(tiny_llama, kind):
    config = {"num_blocks": 12} if kind == "choose_preemption" else {}
    injector = check_fault_contained(tiny_llama, workload_for(kind), kind, 1, 0, **config)
    assert injector.fired, f"the workload never reached the {kind} injection point for the target"


@pytest.mark.parametrize("kind", POOL)
def test_a_pool_hook_fault_disables_the_plugin_and_fails_nobody(tiny_llama, kind):
    config = {"num_blocks": 12} if kind == "block_evicted" else {}
    injector = check_fault_contained(tiny_llama, workload_for(kind), kind, 1, 0, **config)
    assert injector.fired == 1  # disabled after its first raise


def test_a_fault_late_in_a_request_keeps_what_it_had(tiny_llama):
    """After three good samples the target's fourth fails: its first tokens are the fault-free run's."""
    workload = workload_for("sampler")
    reference, _, _ = run(tiny_llama, workload, Injector())
    results, _, _ = run(tiny_llama, workload, Injector("sampler", "r1", after=3))
    kept = results["r1"].outputs[0]
    assert kept.finish_reason == "error" and kept.token_ids == reference["r1"].outputs[0].token_ids[:3]


def test_a_failed_output_build_keeps_the_tokens_of_a_finished_request(tiny_llama):
    """Not streaming, the output is built once the request finished: it ends "error" with its tokens."""
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = random_prompts([5, 7], seed=62)
    engine = tiny_engine(model=tiny_llama, **CONFIG)
    ids = [engine.add_request(p, params) for p in prompts]
    reference = {}
    while engine.has_unfinished():
        reference.update({o.request_id: o for o in engine.step(stream=False)})
    engine = tiny_engine(model=tiny_llama, **CONFIG)
    ids = [engine.add_request(p, params) for p in prompts]
    injector = Injector("detokenize", ids[0])
    results = {}
    with ExitStack() as stack:
        injection_points(stack, injector)
        while engine.has_unfinished():
            results.update({o.request_id: o for o in engine.step(stream=False)})
            engine.check_invariants()
    failed = results[ids[0]].outputs[0]
    assert failed.finish_reason == "error" and "building the output failed" in failed.error
    assert failed.token_ids == reference[ids[0]].token_ids
    assert outcome(results[ids[1]]) == outcome(reference[ids[1]])
    assert engine.stats.failed == 1 and engine.stats.finished == 1
    assert_all_blocks_back(engine)


def test_a_tokenizer_that_cannot_decode_one_token_fails_only_the_request_that_made_it(tiny_llama):
    bad_token = 17

    class Tokenizer:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            if bad_token in ids:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
            return "".join(f"<{i}>" for i in ids)

    def engine():
        return Engine(EngineConfig(device="cpu", **CONFIG), model=tiny_llama, tokenizer=Tokenizer())

    good = random_prompts([6], seed=63)[0]
    plain = engine()
    alone = plain.add_request(good, GREEDY)
    reference = {}
    while plain.has_unfinished():
        reference.update({o.request_id: o for o in plain.step() if o.finished})
    assert bad_token not in reference[alone].token_ids
    mixed = engine()
    ok = mixed.add_request(good, GREEDY)
    forced = mixed.add_request(random_prompts([4], seed=64)[0],
                               SamplingParams(max_tokens=6, logit_bias={bad_token: 100.0}))
    results = {}
    while mixed.has_unfinished():
        results.update({o.request_id: o for o in mixed.step() if o.finished})
        mixed.check_invariants()
    failed = results[forced].outputs[0]
    assert failed.finish_reason == "error" and "UnicodeDecodeError" in failed.error and failed.token_ids == [bad_token]
    assert outcome(results[ok]) == outcome(reference[alone]) and results[ok].text == reference[alone].text
    assert_all_blocks_back(mixed)


def test_a_failing_forward_pass_raises_and_the_next_step_recomputes_it(tiny_llama):
    """The forward pass is everyone's: step raises, nothing advanced, and the run then ends as without it."""
    workload = workload_for("choose_preemption")
    reference, _, _ = run(tiny_llama, workload, Injector(), num_blocks=12)
    engine = tiny_engine(Injector(), model=tiny_llama, **{**CONFIG, "num_blocks": 12})
    for index, (_, prompt, params) in enumerate(workload):
        engine.add_request(prompt, params, request_id=f"r{index}")
    execute, calls = engine.runner.execute, []

    def flaky(out):
        logits = execute(out)  # the KV is written (as a pass failing late would leave it); nothing is advanced
        calls.append(out)
        if len(calls) in (2, 5, 9):
            raise RuntimeError("device lost")
        return logits

    engine.runner.execute = flaky
    results, raised = {}, 0
    sched = engine.scheduler

    def counters():
        return {s.seq_id: (s.num_computed_tokens, len(s.output_token_ids))
                for queue in (sched.running, sched.waiting, sched.swapped) for s in queue}

    while engine.has_unfinished():
        before = counters()
        try:
            outs = engine.step()
        except RuntimeError as exc:
            assert "device lost" in str(exc)
            raised += 1
            after = counters()
            assert after.keys() == before.keys()
            for seq_id, (computed, generated) in after.items():  # no token taken, no counter advanced
                assert generated == before[seq_id][1]
                # the failed step's schedule may have preempted one (back to 0) or admitted one on a prefix hit
                assert computed in (before[seq_id][0], 0) or computed % CONFIG["block_size"] == 0
            engine.check_invariants()
            continue
        results.update({o.request_id: o for o in outs if o.finished})
        engine.check_invariants()
    assert raised == 3
    assert {r: outcome(o) for r, o in results.items()} == {r: outcome(o) for r, o in reference.items()}
    assert_all_blocks_back(engine)


def test_a_sampler_row_that_fails_leaves_every_other_row_and_generator_as_the_batch_would():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=gen)
    params = [SamplingParams(temperature=0.9, seed=11), SamplingParams(temperature=0.7, seed=TARGET_SEED),
              SamplingParams(), SamplingParams(temperature=1.2, top_p=0.8)]
    batch = SamplingBatch(params, [[1, 2]] * 4, [[3]] * 4, [()] * 4, [0, 1, 2, 3])
    clean, faulty = Sampler(3), Sampler(3)
    expected = clean.sample(logits.clone(), batch)
    with ExitStack() as stack:
        injection_points(stack, Injector("sampler", after=0))
        got = faulty.sample(logits.clone(), batch)
    assert [type(e).__name__ if e else None for e in got.errors] == [None, "RuntimeError", None, None]
    assert [t for r, t in enumerate(got.tokens) if r != 1] == [t for r, t in enumerate(expected.tokens) if r != 1]
    for key in (0, 3):  # each generator drew once, as in the clean batch: the next numbers agree
        assert torch.equal(torch.rand(3, generator=clean.generator_for(None, key)),
                           torch.rand(3, generator=faulty.generator_for(None, key)))


# --- the property ----------------------------------------------------------------------------------------

request = st.tuples(
    st.integers(0, 3),  # arrival step
    st.booleans(),  # starts with the shared prefix
    st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=9),
    st.sampled_from(["greedy", "seeded", "unseeded"]),
    st.integers(1, 2),  # n
    st.integers(1, 7),  # max_tokens
)


def build(spec, target: bool, kind: str):
    arrival, shared, tail, mode, n, max_tokens = spec
    prompt = (SHARED if shared else []) + tail
    extra = {"prompt_logprobs": 1} if target and kind == "prompt_logprobs" else {}
    if target:  # the target samples with its own seeds (the sampler and generator faults find it by them)
        return arrival, prompt, SamplingParams(n=n, temperature=0.8, seed=TARGET_SEED, max_tokens=max_tokens,
                                               ignore_eos=True, **extra)
    temperature = 0.0 if mode == "greedy" else 0.9
    seed = 100 + len(tail) if mode == "seeded" else None
    return arrival, prompt, SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens,
                                           ignore_eos=True, **extra)


@settings(max_examples=int(os.environ.get("PAGEDKV_FAULT_EXAMPLES", "50")), deadline=None, derandomize=True,
          database=None)
@given(specs=st.lists(request, min_size=2, max_size=5), kind=st.sampled_from(PER_REQUEST + POOL),
       which=st.integers(0, 4), after=st.integers(0, 3), num_blocks=st.integers(10, 16))
def test_property_bystanders_never_notice_a_fault(tiny_llama, specs, kind, which, after, num_blocks):
    started = time.perf_counter()
    target = which % len(specs)
    workload = [build(spec, i == target, kind) for i, spec in enumerate(specs)]
    injector = check_fault_contained(tiny_llama, workload, kind, target, after, num_blocks=num_blocks)
    TALLY["examples"] += 1
    TALLY["injected"] += bool(injector.fired)
    TALLY["seconds"] += time.perf_counter() - started


def test_the_property_test_really_injected_faults():
    """Runs after the property test (file order): most examples must have reached their fault."""
    if not TALLY["examples"]:
        pytest.skip("the property test did not run in this session")
    print(f"\nstep faults: {TALLY['examples']} examples, {TALLY['injected']} faults injected, "
          f"{TALLY['seconds']:.1f} s")
    assert TALLY["injected"] >= TALLY["examples"] // 2
