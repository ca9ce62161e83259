"""A grammar behind a thinking model's reasoning (issue 42, row 7): every token passes until the end marker's
tokens, then the grammar masks and advances; the prompt's last marker says whether it already ended."""

from __future__ import annotations

import re

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.sample.reasoning_gate import AfterReasoning, ended_in, gated, masking
from pagedkv.core.sample.sampling_params import SamplingParams
from pagedkv.core.sample.structured_output import StructuredOutputs
from pagedkv.testing import BYTE_VOCAB, byte_tokenizer, tiny_llama


class Recorder:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def consume(self, token: int) -> None:
        self.seen.append(token)

    def is_terminated(self) -> bool:
        return len(self.seen) >= 2

    def copy(self) -> Recorder:
        other = Recorder()
        other.seen = list(self.seen)
        return other


def test_the_last_marker_in_the_prompt_decides():
    start, end = (7,), (8, 9)
    assert not ended_in([1, 2, 3], start, end)
    assert ended_in([1, 7, 5, 8, 9, 4], start, end)
    assert not ended_in([8, 9, 7, 5], start, end)  # reopened by a later start marker
    assert not ended_in([1, 8, 5, 9], start, end)  # the marker's tokens, not in a row
    assert ended_in([8, 9], (), end) and not ended_in([], start, end)


def test_the_grammar_sees_only_the_tokens_after_the_end_marker():
    inner = Recorder()
    matcher = gated(inner, [1, 2], (7,), (8, 9))
    assert isinstance(matcher, AfterReasoning) and masking(matcher) is None  # reasoning: nothing masked
    for token in (5, 8, 5, 8):
        matcher.consume(token)
    fork = matcher.copy()
    matcher.consume(9)  # the marker completes
    assert masking(matcher) is inner and inner.seen == [] and not matcher.is_terminated()
    matcher.consume(3)
    matcher.consume(4)
    assert inner.seen == [3, 4] and matcher.is_terminated()
    assert masking(fork) is None and fork.inner is not inner  # a fork goes on from its own state
    assert gated(inner, [8, 9], (7,), (8, 9)).ended  # the prompt closed the reasoning
    assert gated(inner, [1], (), ()) is inner  # no reasoning parser: the grammar as it was


def test_an_engine_leaves_the_reasoning_free_and_constrains_the_answer():
    tokenizer = byte_tokenizer(thinking=True)
    engine = Engine(EngineConfig(device="cpu", num_blocks=128, block_size=8),
                    model=tiny_llama(vocab_size=BYTE_VOCAB, num_hidden_layers=1), tokenizer=tokenizer)
    structured = StructuredOutputs(regex="[a-z]{3}", reasoning_start=(257,), reasoning_end=(258,))
    # the bias makes "~" (126) likely and </think> (258) come after a few: "~" is outside the regex
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=0, structured=structured,
                            logit_bias={126: 20.0, 258: 19.0})
    engine.add_request(tokenizer.encode("hi", add_special_tokens=False), params)
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            text = out.text
    assert re.fullmatch(r"~+</think>[a-z]{3}", text), text  # (without the gate: 3 letters, or no answer)
