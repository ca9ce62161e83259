"""A stand-in for the model runner: a step's shape without its tensors.

``engine simulate`` drives the real scheduler, allocator and plugins with it
(``Engine(config, runner=SimulatedRunner(model_config))``), so capacity questions
are answered by the same code that serves requests. Every sampled token is token
0; requests end by ``max_tokens`` (EOS is never produced).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.core.sched.scheduler import SchedulerOutput


class SimulatedRunner:
    TOKEN = 0  # the only column of its logits, so every sample is this token

    def __init__(self, model_config: Any, logits: bool = True) -> None:
        self.model_config = model_config  # only its shape is read: layers, heads, head size, limits
        self.logits = logits  # False: ``execute`` returns the row count (a SimEngine makes rows only if it samples)
        self.kv_caches: list = []
        self.cpu_kv_caches: Any = None  # (a swap plugin's pool; nothing is copied)
        self.steps = 0
        self.last: SchedulerOutput | None = None  # the newest step (the simulator's clock reads its shape)

    def execute(self, out: SchedulerOutput) -> torch.Tensor | int:
        """Zero "logits", one row per scheduled sequence: enough rows for every sampling one, and all alike."""
        self.steps += 1
        self.last = out
        return torch.zeros((len(out.scheduled), 1)) if self.logits else len(out.scheduled)
