"""Grammar-constrained decoding in the engine: valid output at temperature 1 for 50 seeds, untouched bystanders,
and validity kept through preemption, forks with copy-on-write and prefix caching; a failing grammar ends
its request alone, and compiling never holds up the step loop."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.errors import RequestRejected
from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.llm import LLM
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99999}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"
CHOICES = ["positive", "negative", "neutral"]
SEEDS = range(50)


def make_engine(**config) -> Engine:
    config = {"device": "cpu", "num_blocks": 512, "block_size": 8, "max_num_seqs": 64, **config}
    return Engine(EngineConfig(**config), model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1),
                  tokenizer=byte_tokenizer())


def run(engine: Engine, requests: list[tuple[str, SamplingParams]]) -> list:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    outputs = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for out in engine.step(stream=False):
            outputs[out.request_id] = out
    assert not engine.has_unfinished()
    engine.check_invariants()
    return [outputs[i] for i in ids]


def sampled(structured: StructuredOutputs | None, seed: int, max_tokens: int = 160, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=structured, **kw)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine()


def assert_valid_json(texts: list[str]) -> None:
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_fifty_seeds_at_temperature_one_all_valid(engine, kind):
    structured = {"json": StructuredOutputs(json=SCHEMA), "regex": StructuredOutputs(regex=REGEX),
                  "choice": StructuredOutputs(choice=CHOICES)}[kind]
    outs = run(engine, [("Answer: ", sampled(structured, seed)) for seed in SEEDS])
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), [o.outputs[0].finish_reason for o in outs]
    if kind == "json":
        assert_valid_json(texts)
    elif kind == "regex":
        assert all(re.fullmatch(REGEX, t) for t in texts), texts
    else:
        assert set(texts) <= set(CHOICES) and len(set(texts)) > 1, texts
    assert len(set(texts)) > 1  # temperature 1 really sampled
    assert engine.pool.num_used == 0


def test_an_unconstrained_random_model_does_not_produce_the_structure(engine):
    """The check above can fail: without the grammar the same seeds give no valid output."""
    outs = run(engine, [("Answer: ", sampled(None, seed, max_tokens=40)) for seed in range(10)])
    assert not any(re.fullmatch(REGEX, o.outputs[0].text) for o in outs)


def test_bystanders_are_token_identical(engine):
    bystanders = [("Hello", sampled(None, seed, max_tokens=24)) for seed in range(4)]
    bystanders += [("Hi there", SamplingParams(max_tokens=24, temperature=0.0))]
    alone = run(engine, bystanders)
    constrained = [("Answer: ", sampled(StructuredOutputs(json=SCHEMA), seed)) for seed in range(6)]
    mixed = run(engine, constrained[:3] + bystanders + constrained[3:])
    assert [o.outputs[0].token_ids for o in mixed[3:8]] == [o.outputs[0].token_ids for o in alone]
    assert_valid_json([o.outputs[0].text for o in mixed[:3] + mixed[8:]])


def test_greedy_constrained_is_valid_and_stable(engine):
    params = SamplingParams(max_tokens=160, temperature=0.0, structured=StructuredOutputs(json=SCHEMA))
    first, second = run(engine, [("Answer: ", params), ("Answer: ", params)])
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert_valid_json([first.outputs[0].text])


def test_valid_under_forced_preemption():
    engine = make_engine(num_blocks=40, max_num_seqs=16)
    outs = run(engine, [("Answer: " * 3, sampled(StructuredOutputs(json=SCHEMA), seed)) for seed in range(16)])
    assert engine.scheduler.preemptions, "the pool was meant to be too small for all of them"
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_valid_json([o.outputs[0].text for o in outs])
    assert engine.pool.num_used == 0


def test_forks_with_copy_on_write_each_follow_the_grammar():
    engine = make_engine(enable_copy_on_write=True)
    outs = run(engine, [("Answer: ", sampled(StructuredOutputs(json=SCHEMA), seed, n=4)) for seed in range(3)])
    assert engine.stats.blocks_shared_by_fork > 0
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 12 and len(set(texts)) > 1
    assert_valid_json(texts)
    assert engine.pool.num_used == 0


def test_valid_with_prefix_caching():
    engine = make_engine(enable_prefix_caching=True)
    prompt = "A long shared system prompt that fills several blocks. Answer: "
    first = run(engine, [(prompt, sampled(StructuredOutputs(regex=REGEX), 0))])
    later = run(engine, [(prompt, sampled(StructuredOutputs(regex=REGEX), seed)) for seed in range(1, 9)])
    assert engine.plugin_stats().get("prefix_hits", 1) != 0
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in first + later)


def test_json_object_and_lark_grammar(engine):
    lark = 'start: "(" item ("," item)* ")"\nitem: /[0-9]{1,2}/'
    outs = run(engine, [("x", sampled(StructuredOutputs(json_object=True), 1, max_tokens=300)),
                        ("x", sampled(StructuredOutputs(grammar=lark), 2))])
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[0].outputs[0].text), dict)
    else:  # an unconstrained object may run past its budget; it is still a prefix of one
        assert outs[0].outputs[0].text.startswith("{")
    assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", outs[1].outputs[0].text)


def test_llm_generate_takes_structured_and_refuses_a_bad_schema():
    llm = LLM(hf_model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1), tokenizer=byte_tokenizer(),
              device="cpu", num_blocks=128, block_size=8)
    [out] = llm.generate(["pick: "], SamplingParams(max_tokens=20, temperature=1.0, seed=3,
                                                     structured={"choice": CHOICES}))
    assert out.outputs[0].text in CHOICES
    with pytest.raises(RequestRejected, match="structured_outputs cannot be compiled: .*nonsense"):
        llm.generate(["x"], SamplingParams(structured={"json": {"type": "nonsense"}}))
    with pytest.raises(RequestRejected, match="regex"):
        llm.generate(["x"], SamplingParams(structured={"regex": "a(b"}))
    assert llm.engine.stats.requests == 1  # the bad ones never ran


def test_constraint_needs_exactly_one_kind():
    with pytest.raises(RequestRejected, match="exactly one of"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(RequestRejected, match="exactly one of"):
        SamplingParams(structured={})
    with pytest.raises(RequestRejected, match="choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(RequestRejected, match="unknown field 'jsn'"):
        SamplingParams(structured={"jsn": {}})


def test_an_uncompilable_request_added_directly_ends_alone_with_the_reason(engine):
    bad = SamplingParams(structured=StructuredOutputs(json={"type": "object", "properties": {"a": {"type": 7}}}))
    good = sampled(StructuredOutputs(choice=CHOICES), 1)
    try:
        outs = run(engine, [("x", bad), ("x", good)])
    except RequestRejected:  # compiled before add_request returned: refused at once, equally fine
        outs = None
    if outs is not None:
        assert outs[0].outputs[0].finish_reason == "error" and "compiled" in outs[0].outputs[0].error
        assert outs[1].outputs[0].text in CHOICES


class FlakyBackend:
    """A third-party grammar backend (through the hook) over the real one: it can slow compiles down and make
    one request's matcher fail on its third token."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.compile_threads: set[str] = set()

    @hookimpl
    def pagedkv_register_grammar_backends(self, register):
        from pagedkv.plugins.llguidance_backend import GuidanceBackend

        outer = self

        class Backend(GuidanceBackend):
            def compile(self, constraint):
                outer.compile_threads.add(threading.current_thread().name)
                time.sleep(outer.delay)
                grammar = super().compile(constraint)
                if constraint.kind == "regex" and constraint.regex.startswith("(fail)"):
                    return Failing(grammar)
                return grammar

        register("flaky", Backend, "llguidance with an injected fault")


class Failing:
    def __init__(self, grammar) -> None:
        self.grammar = grammar

    def matcher(self):
        inner = self.grammar.matcher()

        class Matcher:
            count = 0

            def consume(self, token):
                Matcher.count += 1
                if Matcher.count == 3:
                    raise ValueError("injected matcher fault")
                inner.consume(token)

            def is_terminated(self):
                return inner.is_terminated()

            def copy(self):
                return self

            def __getattr__(self, name):
                return getattr(inner, name)

        return Matcher()


def test_a_matcher_error_ends_that_request_alone():
    plugin = FlakyBackend()
    engine = Engine(EngineConfig(device="cpu", num_blocks=256, block_size=8, structured_outputs_backend="flaky"),
                    model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1), tokenizer=byte_tokenizer(),
                    plugins=(plugin,))
    bystander = sampled(None, 5, max_tokens=12)
    outs = run(engine, [("x", sampled(StructuredOutputs(regex="(fail)?[a-z]{4,8}"), 1)), ("y", bystander),
                        ("z", sampled(StructuredOutputs(regex=REGEX), 2))])
    assert outs[0].outputs[0].finish_reason == "error" and "injected matcher fault" in outs[0].outputs[0].error
    assert outs[1].outputs[0].token_ids == run(make_engine(), [("y", bystander)])[0].outputs[0].token_ids
    assert re.fullmatch(REGEX, outs[2].outputs[0].text)
    assert engine.pool.num_used == 0


def test_compiling_never_holds_up_the_step_loop():
    plugin = FlakyBackend(delay=1.0)
    engine = Engine(EngineConfig(device="cpu", num_blocks=256, block_size=8, structured_outputs_backend="flaky"),
                    model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1), tokenizer=byte_tokenizer(),
                    plugins=(plugin,))
    engine.add_request("free", SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), request_id="free")
    engine.step()
    engine.add_request("x", sampled(StructuredOutputs(choice=CHOICES), 1), request_id="constrained")
    steps_while_compiling = 0
    outputs = {}
    while engine.has_unfinished():
        compiling = bool(engine.grammar_gate)
        for out in engine.step(stream=False):
            outputs[out.request_id] = out
        steps_while_compiling += compiling and bool(engine.grammar_gate)
        if "constrained" in outputs:
            engine.abort("free")
    assert steps_while_compiling >= 1  # the free request stepped while the grammar compiled
    assert all(name.startswith("pagedkv-grammar_") for name in plugin.compile_threads)
    assert outputs["constrained"].outputs[0].text in CHOICES


def test_tensor_parallel_two_ranks_give_the_same_valid_outputs():
    greedy = SamplingParams(max_tokens=160, temperature=0.0, structured=StructuredOutputs(json=SCHEMA))
    requests = [(prompt, greedy) for prompt in ("Answer: ", "JSON please", "x")]
    requests += [("Answer: ", sampled(StructuredOutputs(json=SCHEMA), seed)) for seed in range(4)]
    single = run(make_engine(), requests[:3])
    engine = make_engine(tensor_parallel_size=2)
    try:
        sharded = run(engine, requests)
    finally:
        engine.close()
    # greedy: the same tokens as one rank (sampled rows may differ by float rounding of the all-reduce)
    assert [o.outputs[0].token_ids for o in sharded[:3]] == [o.outputs[0].token_ids for o in single]
    assert_valid_json([o.outputs[0].text for o in sharded])
