"""What the sampler needs to know about each row of one step, gathered once by the engine."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedkv.core.sample.sampling_params import SamplingParams

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.sequence import Sequence


@dataclass
class SamplingBatch:
    """Row ``i`` of the step's logits belongs to a sequence with ``params[i]``.

    ``prompt_ids`` / ``output_ids`` are the rows' token histories (read by the penalties; shared, not
    copied), ``banned[i]`` the ids row ``i`` may not produce yet (EOS before ``min_tokens``), ``keys[i]``
    names the row's random generator (stable over the sequence's life, so a seeded request draws the same
    numbers whatever else shares its batch), ``allowed[i]`` row ``i``'s packed grammar mask (None: free).
    """

    params: list[SamplingParams]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    banned: list[SequenceOf[int]]
    keys: list[int]
    allowed: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.allowed:
            self.allowed = [None] * len(self.params)

    @classmethod
    def of(cls, seqs: list[Sequence], banned: list[SequenceOf[int]], keys: list[int],
           allowed: list[torch.Tensor | None] | None = None) -> SamplingBatch:
        return cls(
            [s.params for s in seqs], [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
            banned, keys, allowed or [],
        )

    def __len__(self) -> int:
        return len(self.params)

    @property
    def only_argmax(self) -> bool:
        """Every row is plain greedy: one argmax and nothing else (the simulator's hot path)."""
        return not any(self.banned) and all(mask is None for mask in self.allowed) and all(
            p.greedy and not p.logit_bias and not p.has_penalties and p.logprobs is None and p.allowed_token_ids is None
            for p in self.params
        )
