"""Run statistics: what the summary table and ``--json`` report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # type hints only: this foundation module sits below every room
    from pagedkv.core.engine import Engine
    from pagedkv.core.kv.block_pool import BlockPool
    from pagedkv.core.sched.scheduler_interface import Scheduler
    from pagedkv.core.sched.scheduler_output import SchedulerOutput


@dataclass
class RunStats:
    requests: int = 0
    finished: int = 0
    failed: int = 0  # ended by a plugin fault
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    peak_blocks_used: int = 0
    waste_at_peak: float = 0.0  # allocated slots not holding a token, at the peak of blocks used
    peak_running: int = 0
    preemptions: int = 0
    tokens_recomputed: int = 0
    blocks_shared_by_fork: int = 0
    prefill_tokens_computed: int = 0  # prompt tokens run through the model (prefix hits skip some)
    elapsed: float = 0.0

    def observe_step(self, out: SchedulerOutput, scheduler: Scheduler, used_blocks: int, tokens_held: Callable[[], int],
                     block_size: int) -> None:
        """A step ran: count it, its preemptions, and KV memory (waste is counted only at a new peak)."""
        self.steps += 1
        self.preemptions += len(out.preempted)
        self.tokens_recomputed = scheduler.tokens_discarded
        running = len(scheduler.running)
        if used_blocks >= self.peak_blocks_used:
            self.observe_memory(used_blocks, tokens_held(), block_size, running)
        else:
            self.peak_running = max(self.peak_running, running)

    def observe_memory(self, used_blocks: int, tokens_held: int, block_size: int, running: int) -> None:
        self.peak_running = max(self.peak_running, running)
        if used_blocks > self.peak_blocks_used or (used_blocks == self.peak_blocks_used and used_blocks):
            slots = used_blocks * block_size
            waste = 1.0 - tokens_held / slots if slots else 0.0
            if used_blocks > self.peak_blocks_used:
                self.waste_at_peak = waste
            else:
                self.waste_at_peak = min(self.waste_at_peak, waste)
            self.peak_blocks_used = used_blocks

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.elapsed if self.elapsed > 0 else 0.0


def tokens_held(scheduler: Scheduler, pool: BlockPool, block_size: int, sharing: bool, forks: bool) -> int:
    """Computed tokens in used blocks, counting a shared block once.

    Without sharing, the running sequences' computed tokens. With sharing but no forks (prefix
    caching), every shared block is full for all its holders. With forks a shared last block
    may be partly filled: a set union of the full prefixes plus the partial tails not in it.
    """
    if not sharing:
        return scheduler.computed_tokens()
    if not forks:
        return scheduler.computed_tokens() - block_size * pool.shared_refs
    full: set[int] = set()
    partial: dict[int, int] = {}
    for seq in scheduler.running:
        n = seq.num_computed_tokens
        blocks = seq.block_table.blocks
        k, rest = divmod(n, block_size)
        if k:
            full.update(blocks[:k])
        if rest and k < len(blocks) and partial.get(blocks[k], 0) < rest:
            partial[blocks[k]] = rest
    return block_size * len(full) + sum(f for block_id, f in partial.items() if block_id not in full)


def summarize(engine: Engine) -> dict[str, Any]:
    """The run's figures as ``engine run`` and ``engine simulate`` report them."""
    s = engine.stats
    return {
        "requests": s.requests,
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "elapsed_s": round(s.elapsed, 3),
        "tokens_per_s": round(s.tokens_per_s, 2),
        "steps": s.steps,
        "peak_kv_blocks_used": s.peak_blocks_used,
        "total_kv_blocks": engine.num_blocks,
        "kv_waste_pct_at_peak": round(100 * s.waste_at_peak, 2),
        "peak_running": s.peak_running,
        "preemptions": s.preemptions,
        "tokens_recomputed": s.tokens_recomputed,
        "prefill_tokens_computed": s.prefill_tokens_computed,
        "blocks_free_at_end": engine.pool.num_available,
        **engine.plugin_stats(),
    }
