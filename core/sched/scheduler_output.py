"""What a scheduler hands the engine: the step it decided, and what booking the step's tokens did."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.core.sched.sequence import Sequence

Sample = tuple[Sequence, int, "dict[int, float] | None"]  # a drawn token and its logprobs (if asked for)


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    context_len: int  # tokens already cached before this step

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, so a new one is sampled."""
        return self.context_len + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepUpdate:
    """What a scheduler's ``update_from_output`` did, for the engine's outputs and counters."""

    touched: dict[str, None] = field(default_factory=dict)  # request ids that sampled or finished, in order
    generated: int = 0  # tokens appended
    prefill_tokens: int = 0  # prompt tokens computed
    finished: int = 0
