"""Picks next tokens for a whole batch with tensor ops, keeping per-request seeded generators.

Order (vLLM's): banned tokens (min_tokens), logit bias, penalties; greedy rows take the argmax there.
Sampled rows then go through temperature, min-p, top-k and top-p, and each draws one uniform number
from its own generator: the token is where that number falls in the row's cumulative distribution
(inverse CDF). Every row's arithmetic is independent of the others, so a seeded request gives the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.core.logits_processors import (
    add_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    ban_tokens,
)
from pagedkv.core.logprobs import token_logprobs
from pagedkv.core.sampling_batch import SamplingBatch


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # per row: sampled token + top-k (None where not asked for)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}

    def generator_for(self, seed: int | None, key: int) -> torch.Generator:
        """The generator of the sequence named ``key``: its request's seed, else one derived from the engine's."""
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if seed is not None else (self.seed * 1_000_003 + key) % 2**64)
            self._generators[key] = gen
        return gen

    def forget(self, key: int) -> None:
        self._generators.pop(key, None)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """One token per row of ``logits`` (float32 ``[len(batch), vocab]``, left unchanged)."""
        if batch.only_argmax:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(batch))
        params = batch.params
        scores = logits.clone()
        ban_tokens(scores, batch.banned)
        add_logit_bias(scores, [p.logit_bias for p in params])
        apply_penalties(scores, params, batch.prompt_ids, batch.output_ids)
        chosen = scores.argmax(dim=-1)
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        if sampled:
            index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            chosen[index] = self._draw(scores[index], batch, sampled)
        tokens = chosen.tolist()
        return SamplerOutput(tokens, self._logprobs(logits, batch, tokens))

    def _draw(self, scores: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        device = scores.device
        params = [batch.params[r] for r in rows]
        temperature = torch.tensor([p.temperature for p in params], dtype=scores.dtype, device=device)
        scores = apply_temperature(scores, temperature)
        apply_min_p(scores, torch.tensor([p.min_p for p in params], dtype=scores.dtype, device=device))
        scores = apply_top_k_top_p(scores, [p.top_k for p in params], [p.top_p for p in params])
        cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)
        uniform = torch.cat([torch.rand(1, generator=self.generator_for(p.seed, batch.keys[r]), dtype=torch.float64)
                             for p, r in zip(params, rows)])
        # a target in (0, total]: the first token whose cumulative mass reaches it has a nonzero probability
        target = ((1.0 - uniform).to(device=device, dtype=cdf.dtype) * cdf[:, -1]).unsqueeze(1)
        return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=scores.shape[-1] - 1)

    @staticmethod
    def _logprobs(logits: torch.Tensor, batch: SamplingBatch, tokens: list[int]) -> list[dict[int, float] | None]:
        rows = [r for r, p in enumerate(batch.params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(batch)
        if rows:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            found = token_logprobs(logits[index], [tokens[r] for r in rows], [batch.params[r].logprobs for r in rows])
            for r, entry in zip(rows, found):
                result[r] = entry
        return result
