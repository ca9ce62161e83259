"""The engine's consistency check: every block accounted for, every queue agreeing with its states.

Used by the tests after every operation and by the soak run; cheap enough for debugging runs too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.sched.sequence import SequenceStatus

if TYPE_CHECKING:  # (the engine imports this module)
    from pagedkv.core.engine import Engine


def check_invariants(engine: Engine) -> None:
    """Every block is free, owned by exactly its holders, or kept; queues agree with states.

    Raises ``AssertionError`` naming the first broken rule.
    """
    engine.pool.check()
    sched = engine.scheduler
    bs = engine.config.block_size
    queues = [(sched.running, SequenceStatus.RUNNING), (sched.waiting, SequenceStatus.WAITING),
              (sched.swapped, SequenceStatus.SWAPPED)]
    seen: set[int] = set()
    holders: dict[int, int] = {}
    for queue, status in queues:
        for seq in queue:
            assert seq.seq_id not in seen, f"sequence {seq.request_id} is in two queues"
            seen.add(seq.seq_id)
            assert seq.status is status, f"{seq.request_id} is {seq.status} but queued as {status}"
            assert seq.num_computed_tokens <= seq.num_tokens
            if status is SequenceStatus.SWAPPED:  # its computed tokens live in the CPU pool
                assert not len(seq.block_table), "a swapped sequence holds device blocks"
            else:
                assert len(seq.block_table) * bs >= seq.num_computed_tokens
            for block_id in seq.block_table:
                holders[block_id] = holders.get(block_id, 0) + 1
    for block_id, refs in enumerate(engine.pool.ref_counts):
        assert refs == holders.get(block_id, 0), f"block {block_id}: ref {refs}, held {holders.get(block_id)}"
