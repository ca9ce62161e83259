"""Log-probabilities handed back to the user: per generated token and per prompt token (vLLM's shape).

They come from the log-softmax of the raw model logits, before penalties, bias, temperature or filters
(vLLM's default ``logprobs_mode="raw_logprobs"``): what the model thinks, not what the sampler did.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.scheduler_output import ScheduledSeq


class RankedLogprobs(dict):
    """One position's ``{token id: logprob}`` that also knows each id's 1-based rank in the vocabulary
    (``ranks``), as vLLM's prompt logprobs report it. Still a plain dict to every other reader."""

    def __init__(self, values: dict[int, float], ranks: dict[int, int]) -> None:
        super().__init__(values)
        self.ranks = ranks

    def __reduce__(self) -> tuple:  # pickled whole (the multi-process step channel), ranks included
        return RankedLogprobs, (dict(self), self.ranks)


def token_logprobs(logits: torch.Tensor, token_ids: SequenceOf[int], top: SequenceOf[int],
                   ranked: bool = False) -> list[dict[int, float]]:
    """Per row: ``{token_ids[row]: logprob, then the top[row] most likely ids: logprob}`` (the given token
    first; it appears once if it is among the top). One log-softmax and one device-to-host copy.

    ``ranked``: each entry is a :class:`RankedLogprobs`; the given token's rank counts the ids at least as
    likely (itself included, so ties rank it low, as vLLM does), the top ids rank by their place."""
    if not len(token_ids):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    chosen_t = logprobs.gather(1, chosen_ids.unsqueeze(1))
    chosen = chosen_t.squeeze(1).tolist()
    ranks = (logprobs >= chosen_t).sum(dim=-1).tolist() if ranked else None
    k = min(max(top), logprobs.shape[-1])
    top_values, top_ids = (logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    result = []
    for row, token in enumerate(token_ids):
        entry = {int(token): chosen[row]}
        for rank in range(min(top[row], k)):
            entry.setdefault(top_ids[row][rank], top_values[row][rank])
        if ranks is not None:
            places = {int(token): int(ranks[row])} | {top_ids[row][r]: r + 1 for r in range(min(top[row], k))}
            entry = RankedLogprobs(entry, places)
        result.append(entry)
    return result


def prompt_logprob_span(item: ScheduledSeq) -> tuple[int, int]:
    """Positions of this step whose logits predict a prompt token (position p predicts token p + 1).

    The prompt's last position predicts the first output token: that row is the sampling row, not here.
    Empty unless the request asked for prompt logprobs.
    """
    if item.seq.params.prompt_logprobs is None:
        return 0, 0
    start = item.context_len
    end = min(item.context_len + item.num_new_tokens, len(item.seq.prompt_token_ids) - 1)
    return start, max(start, end)


def record_prompt_logprobs(scheduled: SequenceOf[ScheduledSeq], logits: torch.Tensor) -> None:
    """Append each scheduled sequence's new prompt logprobs; ``logits`` holds, in scheduled order, one row
    per position of :func:`prompt_logprob_span`. A prompt recomputed after preemption is not counted twice."""
    offset = 0
    for item in scheduled:
        start, end = prompt_logprob_span(item)
        if start == end:
            continue
        seq = item.seq
        rows = logits[offset : offset + end - start]
        offset += end - start
        first_new = max(start, len(seq.prompt_logprobs))
        if first_new >= end:
            continue
        targets = seq.prompt_token_ids[first_new + 1 : end + 1]
        k = seq.params.prompt_logprobs
        seq.prompt_logprobs.extend(token_logprobs(rows[first_new - start :], targets, [k] * len(targets), ranked=True))
