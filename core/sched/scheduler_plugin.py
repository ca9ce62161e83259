"""Registers the built-in schedulers (fcfs, priority) through the ``pagedkv`` entry-point group."""

from __future__ import annotations

from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.plugin.plugin_manager import Register
from pagedkv.core.sched.priority_scheduler import PriorityScheduler
from pagedkv.core.sched.scheduler import FCFSScheduler


@hookimpl
def pagedkv_register_schedulers(register: Register) -> None:
    register("fcfs", FCFSScheduler, "first come, first served continuous batching with chunked prefill")
    register("priority", PriorityScheduler, "lower request priority first (vLLM's priority policy); else as fcfs")
