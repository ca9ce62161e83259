"""Copy-on-write for parallel sampling (``SamplingParams(n > 1)``).

A request with n samples is prefilled once (``pagedkv_fork_after_prefill``: the engine
then forks its samples, which share every prompt block by reference count). The only
block ever copied is a shared *partial* last block, just before a sample writes its next
token into it: the allocator sees the shared write and asks ``pagedkv_copy_on_write``,
answered here with ``allocator.replace_block`` (a new block in the sample's table, the
old reference dropped, the copy run before the step's forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.hookspecs import hookimpl

if TYPE_CHECKING:  # type hints only
    import pluggy

    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine
    from pagedkv.core.kv.allocator_interface import Allocator
    from pagedkv.core.sample.sampling_params import SamplingParams
    from pagedkv.core.sched.sequence import Sequence


class CopyOnWrite:
    def __init__(self) -> None:
        self.copies = 0
        self.engine: Engine | None = None

    @hookimpl
    def pagedkv_engine_started(self, engine: Engine) -> None:
        self.engine = engine

    @hookimpl
    def pagedkv_fork_after_prefill(self, params: SamplingParams) -> bool:
        return True

    @hookimpl
    def pagedkv_copy_on_write(self, seq: Sequence, logical_index: int, allocator: Allocator) -> bool:
        allocator.replace_block(seq, logical_index)
        self.copies += 1
        return True

    @hookimpl
    def pagedkv_report_stats(self) -> dict[str, int]:
        saved = self.engine.stats.blocks_shared_by_fork if self.engine is not None else 0
        return {"cow_copies": self.copies, "blocks_saved_by_sharing": saved - self.copies}


@hookimpl
def pagedkv_configure(config: EngineConfig, pm: pluggy.PluginManager) -> None:
    if config.enable_copy_on_write:
        pm.register(CopyOnWrite(), name="copy_on_write.instance")
