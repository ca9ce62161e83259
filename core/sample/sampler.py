"""Picks next tokens for a whole batch with tensor ops, keeping per-request seeded generators.

Order (vLLM's): banned tokens (min_tokens, bad words), allowed tokens (allowed_token_ids), the grammar's
allowed tokens (structured outputs), logit bias, penalties; greedy rows take the argmax there.
Sampled rows then go through temperature, min-p, top-k and top-p, and each draws one uniform number
from its own generator: the token is where that number falls in the row's cumulative distribution
(inverse CDF). Every row's arithmetic is independent of the others, so a seeded request gives the same
tokens whatever else shares its batch, and a row that fails is found by sampling the rows one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedkv.core.sample.logits_processors import (
    add_logit_bias,
    apply_allowed_tokens,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    ban_tokens,
    keep_only,
)
from pagedkv.core.sample.logprobs import token_logprobs
from pagedkv.core.sample.sampling_batch import SamplingBatch
from pagedkv.core.sample.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # per row: sampled token + top-k (None where not asked for)
    errors: list[Exception | None] = field(default_factory=list)  # per row (empty: none failed)


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
        """One token per row of ``logits`` (float32 ``[len(batch), vocab]``, left unchanged).

        A row that cannot be sampled (its generator or one of its processors raises) gets token -1 and its
        exception in ``errors``; every other row gets exactly the token the whole batch would give it. Each
        sampled row draws its uniform number first, once, so a retry never consumes a generator twice.
        """
        size = len(batch)
        if batch.only_argmax:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * size)
        errors: list[Exception | None] = [None] * size
        uniform: dict[int, torch.Tensor] = {}
        for r, p in enumerate(batch.params):
            if not p.greedy:
                try:
                    uniform[r] = torch.rand(1, generator=self.generator_for(p.seed, batch.keys[r]), dtype=torch.float64)
                except Exception as exc:  # noqa: BLE001 - this row's generator: the others go on
                    errors[r] = exc
        rows = [r for r in range(size) if errors[r] is None]
        tokens: list[int] = [-1] * size
        logprobs: list[dict[int, float] | None] = [None] * size
        try:
            self._sample_rows(logits, batch, rows, uniform, tokens, logprobs)
        except Exception as exc:  # noqa: BLE001 - find the failing rows: each alone, as the batch would give it
            if len(rows) == 1:
                errors[rows[0]] = exc
            else:
                for r in rows:
                    try:
                        self._sample_rows(logits, batch, [r], uniform, tokens, logprobs)
                    except Exception as row_exc:  # noqa: BLE001
                        errors[r] = row_exc
        return SamplerOutput(tokens, logprobs, errors if any(e is not None for e in errors) else [])

    def _sample_rows(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int],
                     uniform: dict[int, torch.Tensor], tokens: list[int], logprobs: list[Any]) -> None:
        """Sample ``rows`` of the batch together; their tokens and logprobs are written only if all succeed."""
        if not rows:
            return
        if len(rows) != len(batch):
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            logits = logits[index]
            batch = SamplingBatch(*([getattr(batch, name)[r] for r in rows] for name in
                                    ("params", "prompt_ids", "output_ids", "banned", "keys", "allowed")))
        params = batch.params
        scores = logits.clone()
        ban_tokens(scores, batch.banned)
        if any(p.allowed_token_ids is not None for p in params):
            keep_only(scores, [p.allowed_token_ids for p in params])
        apply_allowed_tokens(scores, batch.allowed)
        add_logit_bias(scores, [p.logit_bias for p in params])
        apply_penalties(scores, params, batch.prompt_ids, batch.output_ids)
        chosen = scores.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            index = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            draws = torch.cat([uniform[rows[i]] for i in sampled])
            chosen[index] = self._draw(scores[index], [params[i] for i in sampled], draws)
        row_tokens = chosen.tolist()
        row_logprobs = self._logprobs(logits, batch, row_tokens)
        for i, r in enumerate(rows):
            tokens[r], logprobs[r] = row_tokens[i], row_logprobs[i]

    @staticmethod
    def _draw(scores: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
        device = scores.device
        temperature = torch.tensor([p.temperature for p in params], dtype=scores.dtype, device=device)
        scores = apply_temperature(scores, temperature)
        apply_min_p(scores, torch.tensor([p.min_p for p in params], dtype=scores.dtype, device=device))
        scores = apply_top_k_top_p(scores, [p.top_k for p in params], [p.top_p for p in params])
        cdf = torch.softmax(scores, dim=-1).cumsum(dim=-1)
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
