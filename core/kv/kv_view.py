"""A read-only view of the KV cache, for observers (the telemetry plugin, tests, tools).

Everything is answered from the engine's own pool, scheduler and swap space at the
moment of the call, as copies: an observer can neither change the engine through it
nor depend on how the core stores its state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.kv.block_pool import BlockPool
from pagedkv.core.kv.swap_space import SwapSpace

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.scheduler_interface import Scheduler
    from pagedkv.core.sched.sequence import Sequence


class KVCacheView:
    def __init__(
        self,
        pool: BlockPool,
        scheduler: Scheduler,
        block_size: int,
        swap_space: SwapSpace | None,
    ) -> None:
        self._pool = pool
        self._scheduler = scheduler
        self._swap = swap_space
        self.block_size = block_size
        self.num_blocks = pool.num_blocks

    # --- blocks ------------------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return self._pool.num_used

    @property
    def num_free(self) -> int:
        """Free blocks holding nothing reusable."""
        return self._pool.num_free

    @property
    def num_cached(self) -> int:
        """Free blocks whose content a plugin keeps reusable (evicted last)."""
        return self._pool.num_cached

    def ref_counts(self) -> list[int]:
        return list(self._pool.ref_counts)

    def cached_blocks(self) -> list[int]:
        """Cached blocks, the next to be evicted first."""
        return self._pool.cached_blocks()

    def computed_tokens(self) -> int:
        """Computed tokens over the running sequences, each counted in full."""
        return self._scheduler.computed_tokens()

    # --- requests ----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def num_swapped(self) -> int:
        return len(getattr(self._scheduler, "swapped", ()) or ())

    def requests(self) -> dict[str, list[Sequence]]:
        """Unfinished request id -> its sequences (running, then waiting, then swapped)."""
        sched = self._scheduler
        groups: dict[str, list[Sequence]] = {}
        for seq in [*sched.running, *sched.waiting, *(getattr(sched, "swapped", ()) or ())]:
            if not seq.is_finished:
                groups.setdefault(seq.request_id, []).append(seq)
        return groups

    def num_samples(self, seqs: list[Sequence]) -> int:
        """Samples of one request (its entry in :meth:`requests`): live sequences plus those still to fork (n > 1)."""
        return len(seqs) + sum(s.pending_forks for s in seqs)

    def running(self) -> list[Sequence]:
        """The running sequences, in running order."""
        return list(self._scheduler.running)

    # --- swap --------------------------------------------------------------------------------------

    @property
    def num_cpu_blocks(self) -> int:
        return self._swap.num_blocks if self._swap is not None else 0

    def cpu_blocks(self, seq: Sequence) -> list[int]:
        """The sequence's blocks in the swap space, in table order (empty unless it is swapped out)."""
        return self._swap.blocks_of(seq) if self._swap is not None else []
