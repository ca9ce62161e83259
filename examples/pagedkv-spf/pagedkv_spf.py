"""Shortest-prompt-first scheduling for pagedkv, registered as ``EngineConfig(scheduler="spf")``.

The ``pagedkv`` entry point of this package points at this module; pagedkv's
plugin manager registers it, and the engine runs ``pagedkv_register_schedulers``
once while it builds its scheduler registry. The module keeps no state, so one
import serves every engine in the process.
"""

from __future__ import annotations

from typing import Any

from pagedkv.core.hookspecs import hookimpl
from pagedkv.core.sched.scheduler import FCFSScheduler
from pagedkv.core.sched.sequence import Sequence

__version__ = "0.1.0"


class ShortestPromptFirstScheduler(FCFSScheduler):
    """FCFS continuous batching, except that waiting requests are admitted shortest prompt first.

    Only the order of the waiting queue changes: a new sequence is placed before the first
    waiting sequence that has never run and has a longer prompt (so equal lengths keep their
    arrival order). Preempted sequences, which the scheduler puts back at the front of the
    queue, stay there: work already started is finished first.
    """

    name = "spf"

    def add(self, seq: Sequence) -> None:
        super().add(seq)  # appends it and marks it waiting
        self.waiting.pop()
        length = len(seq.prompt_token_ids)
        for index, other in enumerate(self.waiting):
            if other.num_preemptions == 0 and len(other.prompt_token_ids) > length:
                self.waiting.insert(index, seq)
                return
        self.waiting.append(seq)


@hookimpl
def pagedkv_register_schedulers(register: Any) -> None:
    register("spf", ShortestPromptFirstScheduler, "shortest prompt first; otherwise as fcfs")
