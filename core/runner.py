"""What the engine needs from whatever runs the model for a step.

The engine builds a :class:`~pagedkv.core.model.model_runner.ModelRunner` itself when none is
given; ``engine simulate`` gives a stand-in that only counts tokens
(``Engine(config, runner=SimulatedRunner(shape))``), and the same pool, allocator,
scheduler and plugins run around it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from pagedkv.core.config import EngineConfig
from pagedkv.core.kv.kv_cache import KVCacheSpec
from pagedkv.core.kv.swap_space import SwapSpace
from pagedkv.core.sched.scheduler_output import SchedulerOutput

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer, (k, v)


class Runner(Protocol):
    """Runs one scheduled step."""

    model_config: Any  # the HF config (or anything with its shape fields): sizes the KV cache
    kv_caches: KVCaches  # device KV tensors, per layer (empty for a stand-in)
    cpu_kv_caches: KVCaches | None  # the CPU swap pool's tensors, if a swap plugin gave it some

    def execute(self, out: SchedulerOutput) -> Any:
        """Logits ``[num_sampling_seqs, vocab]`` in scheduled order, one row per sequence that samples."""
        ...


def make_runner(config: EngineConfig, model: torch.nn.Module, backend: Any, spec: KVCacheSpec, num_blocks: int,
                swap_space: SwapSpace | None, from_config: bool) -> Runner:
    """The runner for a real model: one process, or rank 0 of ``config.tensor_parallel_size`` ranks."""
    from pagedkv.core.model.model_runner import ModelRunner

    if config.tensor_parallel_size <= 1:
        return ModelRunner(model, backend, spec, num_blocks, config.device, swap_space)
    from pagedkv.core.dist.tp_runner import TensorParallelRunner
    from pagedkv.core.model.model_support import check_model_support

    check_model_support(model)  # on the whole model, before it is sharded (a probe forward on one rank would hang)
    return TensorParallelRunner.launch(config, model, backend, spec, num_blocks, from_config, swap_space)
