"""How to pick the next tokens of one request (vLLM's ``SamplingParams`` shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.core.errors import RequestRejected


@dataclass
class SamplingParams:
    """Sampling settings; ``temperature=0`` is greedy.

    ``seed`` makes a sampled request reproducible on its own, whatever else is
    in the batch. ``n > 1`` asks for several samples sharing the prompt.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise RequestRejected(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise RequestRejected(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestRejected(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise RequestRejected(f"n must be at least 1, got {self.n}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise RequestRejected("min_tokens must be in 0..max_tokens")
        if any(not s for s in self.stop):
            raise RequestRejected("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
