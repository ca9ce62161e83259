"""A request's state as it moves through the engine, and what the user gets back."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.core.kv.block_table import BlockTable
from pagedkv.core.sample.detokenizer import IncrementalDetokenizer, output_text
from pagedkv.core.sample.grammar_backend import GrammarMatcher
from pagedkv.core.sample.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    COMPILING = "compiling"  # a constrained request waiting for its grammar, outside the scheduler
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)  # a sequence is itself, not its contents: queue removal compares identity
class Sequence:
    """One stream of tokens with its own block table.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the
    scheduler moves it forward, and resets it to 0 when the sequence is
    preempted by recompute.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int
    arrival: int = 0
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: BlockTable = field(default_factory=BlockTable)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    output_text: str = ""
    pending_forks: int = 0  # samples still to fork from this sequence after its prefill (n > 1)
    cache_salt: str | None = None  # keeps prefix-cache entries of different tenants apart
    error: str | None = None  # why the request failed (finish reason "error")
    run_order: int = 0  # stamped by the scheduler each time it starts running: the running queue's order
    seq_id: int = field(default_factory=lambda: next(_seq_ids))  # unique in the process, unlike id()
    # its output text, decoded a few tokens at a time
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)  # one per output token (logprobs set)
    cumulative_logprob: float = 0.0  # sum of the sampled tokens' logprobs (kept when logprobs is set)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # for prompt tokens 1.. (prompt_logprobs)
    priority: int = 0  # lower runs first under the priority scheduler (vLLM's meaning)
    arrival_step: int = 0  # the scheduler step it was queued at (the priority scheduler's aging)
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache held when it was first admitted
    # its grammar's state (structured outputs), fed every token
    matcher: GrammarMatcher | None = field(default=None, repr=False)
    grammar_done: bool = False  # finished because its grammar was complete: the last token is text, not EOS
    held: bool = False  # its next grammar mask is still being computed (mask_ahead): not scheduled this step

    @classmethod
    def sample_of(cls, request_id: str, token_ids: list[int], params: SamplingParams, index: int, max_len: int,
                  prompt: str | None = None, cache_salt: str | None = None) -> Sequence:
        """Sample ``index`` of a request; with a seed, sample i uses seed + i (as n separate requests would)."""
        if params.n > 1 and params.seed is not None:
            params = replace(params, seed=params.seed + index)
        return cls(request_id, list(token_ids), params, max_len=max_len, prompt=prompt, cache_salt=cache_salt)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without copying the whole history (a decode asks for one token)."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : end - len(prompt)]
        return prompt[start:] + self.output_token_ids[: end - len(prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token: int, logprobs: dict[int, float] | None = None) -> None:
        """A new output token, with its logprobs when the request asked for them."""
        self.output_token_ids.append(token)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token]

    def pop_token(self) -> None:
        """Undo the last :meth:`append_token` (a token the stop check could not accept)."""
        token = self.output_token_ids.pop()
        if len(self.output_logprobs) > len(self.output_token_ids):
            self.cumulative_logprob -= self.output_logprobs.pop()[token]

    def completion(self, index: int) -> CompletionOutput:
        """This sample as the user sees it (a snapshot: later tokens do not change it)."""
        wants = self.params.logprobs is not None
        return CompletionOutput(
            index, self.output_text, list(self.output_token_ids), self.finish_reason, self.stop_reason, self.error,
            list(self.output_logprobs) if wants else None, self.cumulative_logprob if wants else None,
        )

    def prompt_logprobs_out(self) -> list[dict[int, float] | None] | None:
        """vLLM's shape: None for the first prompt token (nothing predicts it), then one entry per token."""
        if self.params.prompt_logprobs is None:
            return None
        return [None, *self.prompt_logprobs]


@dataclass
class CompletionOutput:
    """One sample. With ``SamplingParams.logprobs`` set, ``logprobs[i]`` maps token ids to log-probabilities
    for generated token ``i`` (the sampled one plus the top ones) and ``cumulative_logprob`` sums the sampled
    tokens'; both are None otherwise."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What ``LLM.generate`` and ``Engine.step`` hand back (vLLM's shape).

    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``): one entry per prompt token, None for
    the first (nothing predicts it), else {token id: logprob} with the prompt token plus the top ones.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's field)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @classmethod
    def of(cls, request_id: str, seqs: list[Sequence], finished: bool, tokenizer: Any = None) -> RequestOutput:
        """A request's output now: each sample's tokens, and its text (cut at a stop string, if one ended it)."""
        completions = []
        for index, seq in enumerate(seqs):
            if not isinstance(seq.stop_reason, str):
                seq.output_text = output_text(seq, tokenizer, final=seq.is_finished)
            completions.append(seq.completion(index))
        first = seqs[0]
        return cls(request_id, first.prompt, list(first.prompt_token_ids), completions, finished,
                   first.prompt_logprobs_out(), first.num_cached_tokens or 0)
