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
    TOKEN = 0  # the only column of its logits, so every sample is this token
    kv_caches: list = []
    cpu_kv_caches = None

    def __init__(self) -> None:
        self.steps = 0

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Zero "logits", one row per scheduled sequence: enough rows for every sampling one, and all alike."""
        self.steps += 1
        return torch.zeros((len(out.scheduled), 1))
