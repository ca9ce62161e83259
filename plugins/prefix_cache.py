"""Automatic prefix caching: full blocks are found again by a hash of everything before them.

A block's key is ``hash(parent key, its token ids, salt)``, so equal keys mean
equal prefixes (token ids are compared too, since hashes can collide). This
plugin only indexes blocks: a full block is registered when it fills
(``pagedkv_on_block_full``); when its ref count drops to 0 the pool is told to
keep it cached (``pagedkv_on_block_released``); a new request's matching blocks
are handed to the allocator, which revives them (``pagedkv_match_prefix``);
and a block the pool evicts is forgotten (``pagedkv_on_block_evicted``). The
pool's free queue decides eviction: least recently released first, only when
no plain free block is left (a finished request's tail is released first, so
shared heads live longest).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from pagedkv.core.hookspecs import hookimpl

if TYPE_CHECKING:  # type hints only
    from collections.abc import Iterator

    import pluggy

    from pagedkv.core.config import EngineConfig
    from pagedkv.core.engine import Engine
    from pagedkv.core.kv.allocator_interface import Allocator
    from pagedkv.core.kv.block_pool import BlockPool
    from pagedkv.core.sched.sequence import Sequence


class PrefixCache:
    def __init__(self) -> None:
        self.by_key: dict[int, int] = {}  # key -> block id
        self.block_info: dict[int, tuple[int, tuple[int, ...]]] = {}  # block id -> (key, token ids)
        self.block_size = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.recompute_hit_tokens = 0  # hits while re-running a preempted request: not real sharing
        self.evictions = 0
        # sequence -> the preemption count of its admission attempt already in the metrics. Weak keys: an entry
        # lives as long as its sequence, so the memory is bounded by the live requests, not by every request seen
        self._counted: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    @hookimpl
    def pagedkv_engine_started(self, engine: Engine) -> None:
        self.block_size = engine.config.block_size

    # --- keys ---------------------------------------------------------------------------------------

    def _chunks(self, seq: Sequence, num_blocks: int) -> Iterator[tuple[int, tuple[int, ...]]]:
        """(key, token ids) of the sequence's first ``num_blocks`` full blocks."""
        tokens = seq.token_ids
        key = hash(("pagedkv", seq.cache_salt))
        for i in range(num_blocks):
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            key = hash((key, chunk))
            yield key, chunk

    # --- hooks ----------------------------------------------------------------------------------------

    @hookimpl
    def pagedkv_on_block_full(self, seq: Sequence, logical_index: int, block_id: int) -> None:
        if block_id in self.block_info:
            return
        parent = self.block_info.get(seq.block_table[logical_index - 1]) if logical_index else None
        if parent is not None or not logical_index:  # chain from the block before: O(1), not O(length)
            bs = self.block_size
            chunk = tuple(seq.token_slice(logical_index * bs, (logical_index + 1) * bs))
            key = hash((parent[0] if parent is not None else hash(("pagedkv", seq.cache_salt)), chunk))
        else:  # the block before was not registered (an equal block already was): hash the whole prefix
            *_, (key, chunk) = self._chunks(seq, logical_index + 1)
        if key not in self.by_key:
            self.by_key[key] = block_id
            self.block_info[block_id] = (key, chunk)

    @hookimpl
    def pagedkv_match_prefix(self, seq: Sequence, allocator: Allocator) -> list[int]:
        max_blocks = (seq.num_tokens - 1) // self.block_size  # the last token is always computed
        blocks = []
        for key, chunk in self._chunks(seq, max_blocks):
            block_id = self.by_key.get(key)
            if block_id is None or self.block_info[block_id][1] != chunk:
                break
            blocks.append(block_id)
        hit = len(blocks) * self.block_size
        if self._counted.get(seq) == seq.num_preemptions:  # the queue head retries admission every step:
            return blocks                                     # count each attempt once
        self._counted[seq] = seq.num_preemptions
        if seq.num_preemptions:
            self.recompute_hit_tokens += hit
        else:
            self.query_tokens += len(seq.prompt_token_ids)
            self.hit_tokens += hit
        return blocks

    @hookimpl
    def pagedkv_on_block_released(self, block_id: int) -> bool:
        return block_id in self.block_info

    @hookimpl
    def pagedkv_on_block_evicted(self, block_id: int) -> None:
        key, _ = self.block_info.pop(block_id)
        del self.by_key[key]
        self.evictions += 1

    @hookimpl
    def pagedkv_report_stats(self) -> dict[str, Any]:
        return {
            "prefix_query_tokens": self.query_tokens,
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_hit_rate": round(self.hit_tokens / self.query_tokens, 4) if self.query_tokens else 0.0,
            "prefix_recompute_hit_tokens": self.recompute_hit_tokens,
            "prefix_cached_blocks": len(self.block_info),
            "prefix_evictions": self.evictions,
        }

    def check(self, pool: BlockPool) -> None:
        """Invariants for tests: the pool's cached blocks are exactly the indexed ones nobody holds;
        keys point back."""
        unheld = {block_id for block_id in self.block_info if pool.ref_counts[block_id] == 0}
        assert set(pool.cached_blocks()) == unheld
        for block_id, (key, _) in self.block_info.items():
            assert self.by_key[key] == block_id


@hookimpl
def pagedkv_configure(config: EngineConfig, pm: pluggy.PluginManager) -> None:
    if config.enable_prefix_caching:
        pm.register(PrefixCache(), name="prefix_cache.instance")
