"""Picks next tokens: greedy, temperature, top-k, top-p, with per-request seeds."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

import torch

from pagedkv.core.sequence import Sequence


class Sampler:
    """Greedy rows are one vectorized argmax; sampled rows each use their request's generator,
    so a seeded request gives the same tokens whatever else shares its batch."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}

    def generator_for(self, seq: Sequence, key: int) -> torch.Generator:
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seq.params.seed if seq.params.seed is not None else self.seed * 1_000_003 + key)
            self._generators[key] = gen
        return gen

    def forget(self, key: int) -> None:
        self._generators.pop(key, None)

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        key_of: Callable[[Sequence], int],
        banned: list[SequenceOf[int]],
    ) -> list[int]:
        """One token per row of ``logits`` (float32 ``[N, vocab]``).

        ``banned[i]`` are token ids row ``i`` may not produce yet (EOS before ``min_tokens``);
        ``key_of(seq)`` names a sampled sequence's generator (asked only for non-greedy rows).
        """
        for row, ids in enumerate(banned):
            if ids:
                logits[row, ids] = float("-inf")
        tokens = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = self._sample_row(logits[row], seq, self.generator_for(seq, key_of(seq)))
        return tokens

    @staticmethod
    def _sample_row(row: torch.Tensor, seq: Sequence, gen: torch.Generator) -> int:
        p = seq.params
        scores = row.cpu() / p.temperature
        if p.top_k and p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs >= p.top_p  # keep the smallest set reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen).item())
