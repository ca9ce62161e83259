"""Both ends of a tensor-parallel step.

Rank 0's :class:`TensorParallelRunner` stands in for the engine's runner: it packs the step
(:class:`~pagedkv.core.model.model_runner.StepBatch`: tokens, block tables, lengths, swap and
copy-on-write block moves), broadcasts it in one collective, then runs its own shard. Every
other rank runs :func:`serve`: receive, run the same batch on its shard and its share of the
KV heads, repeat, until rank 0 sends ``None``. Scheduling, allocation, plugins and sampling
happen on rank 0 only; the other ranks see only the batches.
"""

from __future__ import annotations

import signal
import sys
import traceback
from dataclasses import replace
from typing import Any

import torch

from pagedkv.core.dist.distributed import (
    IDLE_TIMEOUT,
    TensorParallelError,
    TensorParallelGroup,
    collective_timeout,
    quiet_transformers,
    rank_device,
)
from pagedkv.core.kv.kv_cache import KVCacheSpec, allocate_kv_caches
from pagedkv.core.model.model_runner import ModelRunner
from pagedkv.core.sched.scheduler_output import SchedulerOutput
from pagedkv.core.dist.tensor_parallel import rank_spec


class TensorParallelRunner:
    """Rank 0's runner over N ranks; any failure of a rank stops them all and raises :class:`TensorParallelError`."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup, num_blocks: int) -> None:
        self.inner = runner
        self.group = group
        cpu_caches = runner.cpu_kv_caches  # a swap space's host pool: every rank keeps its own share of it
        cpu_blocks = int(cpu_caches[0][0].shape[0]) if cpu_caches else 0
        self._guarded(lambda: group.broadcast({"num_blocks": num_blocks, "cpu_blocks": cpu_blocks}))
        self._guarded(group.wait_ready)

    @classmethod
    def launch(cls, config: Any, model: Any, backend: Any, spec: KVCacheSpec, num_blocks: int,
               from_config: bool, swap_space: Any = None) -> TensorParallelRunner:
        """Start (or, under torchrun, join) the ranks and shard ``model`` to rank 0's part; ``spec`` is per rank."""
        group = TensorParallelGroup.launch(config, model, from_config, spawned_main)
        if group.rank != 0:  # another process of a torchrun launch: serve rank 0's steps, then leave
            serve(group, config, model)
            raise SystemExit(0)
        runner = ModelRunner(model, backend, spec, num_blocks, group.device, swap_space, check_support=False)
        return cls(runner, group, num_blocks)

    @property
    def model_config(self) -> Any:
        return self.inner.model.config

    @property
    def kv_caches(self) -> list:
        return self.inner.kv_caches

    @property
    def cpu_kv_caches(self) -> Any:
        return self.inner.cpu_kv_caches

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        batch = self.inner.pack(out)

        def step() -> torch.Tensor:
            self.group.broadcast(replace(batch, sample_rows=[]))
            return self.inner.run(batch)

        return self._guarded(step)

    def _guarded(self, action: Any) -> Any:
        if self.group.closed:
            raise TensorParallelError("this tensor-parallel engine was closed; make a new one")
        self.group.check_workers()
        try:
            return action()
        except Exception as exc:  # noqa: BLE001 - mid-step, the ranks are out of step: stop them all
            self.group.fail(exc)

    def close(self) -> None:
        self.group.close()


def serve(group: TensorParallelGroup, config: Any, model: Any) -> None:
    """The loop of every rank but 0: run each broadcast batch on this rank's shard until ``None`` comes."""
    from pagedkv.core.plugin.plugin_manager import build_registry, make_plugin_manager

    group.shard(model)
    model.to(group.device)
    backend = build_registry(make_plugin_manager(()), "backend", "pagedkv_register_backends").get(config.backend)
    hello = group.broadcast(None)
    if hello is None:  # rank 0 stopped before its first step
        return
    spec = rank_spec(KVCacheSpec.from_model_config(model.config, config.block_size, config.kv_dtype), group.world_size)
    runner = ModelRunner(model, backend.factory(config), spec, hello["num_blocks"], group.device, check_support=False)
    runner.cpu_kv_caches = _cpu_pool(spec, hello["cpu_blocks"], group.device)  # its share of the swap space
    group.ready()
    with torch.inference_mode():
        while (batch := group.broadcast(None)) is not None:
            runner.run(batch)
    group.close()


def _cpu_pool(spec: KVCacheSpec, num_blocks: int, device: str) -> Any:
    if not num_blocks:
        return None
    caches = allocate_kv_caches(spec, num_blocks, "cpu")
    return [(k.pin_memory(), v.pin_memory()) for k, v in caches] if device.startswith("cuda") else caches


def spawned_main(rank: int, world_size: int, port: int, config: Any, source: str, threads: int) -> None:
    """Entry point of a rank the engine started: join the group, load the model from ``source``, serve."""
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops every rank
    try:
        torch.set_num_threads(threads)
        device = rank_device(config.device, rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=collective_timeout())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
        group = TensorParallelGroup(rank, world_size, device, [], None)
        from transformers import AutoModelForCausalLM

        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=config.dtype).eval()
        serve(group, config, model)
    except Exception:  # noqa: BLE001 - the traceback goes to stderr; rank 0 reports the exit code
        print(f"pagedkv tensor-parallel rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.exit(1)


__all__ = ["TensorParallelError", "TensorParallelRunner", "serve", "spawned_main"]
