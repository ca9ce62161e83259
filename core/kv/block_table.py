"""A sequence's page table: logical block i -> physical block id."""

from __future__ import annotations


class BlockTable:
    """The blocks a sequence holds, in logical order.

    The table never holds a block id twice; it is only the mapping, while the
    pool owns the ref counts.
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: list[int] | None = None) -> None:
        self.blocks: list[int] = list(blocks or [])

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self):
        return iter(self.blocks)

    def __getitem__(self, logical: int) -> int:
        return self.blocks[logical]

    def append(self, block_id: int) -> None:
        self.blocks.append(block_id)

    def replace(self, logical: int, block_id: int) -> None:
        """Point logical block ``logical`` at another physical block (a copy-on-write copy)."""
        self.blocks[logical] = block_id

    def capacity(self, block_size: int) -> int:
        """Tokens the table can hold."""
        return len(self.blocks) * block_size

    def slot(self, position: int, block_size: int) -> int:
        """The flat cache slot of token ``position``."""
        return self.blocks[position // block_size] * block_size + position % block_size

    def clear(self) -> list[int]:
        blocks, self.blocks = self.blocks, []
        return blocks

    def __repr__(self) -> str:
        return f"BlockTable({self.blocks})"
