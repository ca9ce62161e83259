"""The allocator interface: what the engine, the scheduler and plugins call on a block allocator.

An allocator decides how a sequence's block table grows, shares and shrinks over the engine's one
:class:`~pagedkv.core.kv.block_pool.BlockPool`. The engine builds it once, with
``factory(pool, block_size, hooks)`` (:class:`AllocatorFactory`): ``hooks`` holds the plugin
decisions it may ask, or is None when no plugin makes any (then nothing is ever shared and the
allocator may take its fast path). :class:`~pagedkv.core.kv.allocator.PagedAllocator` is the
reference implementation; subclass it to change one rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagedkv.core.kv.block_pool import BlockPool

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.sequence import Sequence


class MatchPrefix(Protocol):
    """``pagedkv_match_prefix``: block ids already holding ``seq``'s first full blocks, or None."""

    def __call__(self, *, seq: Sequence, allocator: Allocator) -> list[int] | None: ...


class CopyOnWrite(Protocol):
    """``pagedkv_copy_on_write``: True once ``seq`` has its own copy of the shared block it is about to write."""

    def __call__(self, *, seq: Sequence, logical_index: int, allocator: Allocator) -> bool | None: ...


@dataclass(frozen=True)
class AllocatorHooks:
    """The plugin decisions an allocator asks (each None when no plugin makes it). A plugin that
    raises in one surfaces as a :class:`~pagedkv.core.plugin.plugin_guard.PluginFault`, which fails
    the request being served."""

    match_prefix: MatchPrefix | None = None  # on admission: cached blocks to start from
    copy_on_write: CopyOnWrite | None = None  # before writing into a block other sequences share


class Allocator(Protocol):
    """A block allocator, as the engine, the scheduler and plugins use it."""

    name: str
    pool: BlockPool
    block_size: int

    def blocks_to_reserve(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq``'s table must hold for ``num_tokens`` tokens."""

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks :meth:`allocate_slots` would take from the pool for ``num_new_tokens`` more tokens."""

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens, all or nothing; False if the pool is short."""

    def match_prefix(self, seq: Sequence) -> int:
        """On admission: take over cached blocks holding ``seq``'s prefix; returns the tokens skipped."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (ref counts up, nothing copied)."""

    def replace_block(self, seq: Sequence, logical_index: int) -> tuple[int, int]:
        """Give ``seq`` a private copy of its block ``logical_index``; returns ``(old, new)`` (copy-on-write)."""

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` block copies made since the last call, for this step's output."""

    def free(self, seq: Sequence) -> None:
        """Give back every reference ``seq`` holds."""


class AllocatorFactory(Protocol):
    """What ``pagedkv_register_allocators`` registers (a class such as ``PagedAllocator`` is one)."""

    def __call__(self, pool: BlockPool, block_size: int, hooks: AllocatorHooks | None = None) -> Allocator: ...
