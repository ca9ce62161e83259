"""A stand-in for the model runner: a step's shape without its tensors.

``engine simulate`` drives the real scheduler, allocator and plugins with it,
so capacity questions are answered by the same code that serves requests.
Every sampled token is token 0; requests end by ``max_tokens`` (EOS is never
produced).
"""

from __future__ import annotations

import torch

from pagedkv.core.scheduler import SchedulerOutput


class SimulatedRunner:
    kv_caches: list = []
    cpu_kv_caches = None

    def __init__(self) -> None:
        self.steps = 0
        self.tokens = 0

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """One row of one-token "logits" per sampling sequence."""
        self.steps += 1
        self.tokens += out.num_batched_tokens
        return torch.zeros((sum(1 for item in out.scheduled if item.samples), 1))
