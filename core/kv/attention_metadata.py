"""Per-step attention metadata: built once per step, shared by every layer.

All backends read the same object, so its fields are the contract between the
scheduler's decisions and the kernels. Index tensors live on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class AttentionMetadata:
    """What one packed step looks like to attention.

    The step's tokens are packed: sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``. Its KV history after this
    step's write is ``seq_lens[i]`` tokens long, of which ``context_lens[i]``
    were cached before this step. Query row ``j`` of sequence ``i`` sits at
    absolute position ``context_lens[i] + j`` and may attend to keys at
    positions ``< context_lens[i] + j + 1`` (causal, aligned bottom-right).
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]; slot = block * block_size + offset; -1 = skip
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]; padded with 0 past a sequence's blocks
    seq_lens: torch.Tensor  # int32 [num_seqs]; context + new tokens
    context_lens: torch.Tensor  # int32 [num_seqs]; tokens cached before this step
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]; cu_seqlens of the packed queries
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so a Python-level backend never syncs a device to read lengths.
    query_lens_cpu: tuple[int, ...] = ()
    seq_lens_cpu: tuple[int, ...] = ()
    # Per-step scratch a backend may fill once and reuse in every layer (e.g. a mask).
    backend_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        *,
        block_tables: list[list[int]],
        context_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the tensors from plain Python lists (one entry per sequence).

        Every index tensor is a view into one host buffer, so a CUDA step costs a
        single (pinned, non-blocking) host-to-device copy instead of one blocking
        copy per tensor; the layers see the data in stream order, without a sync.
        """
        if not (len(block_tables) == len(context_lens) == len(query_lens)):
            raise ValueError("block_tables, context_lens and query_lens must have one entry per sequence")
        num_seqs = len(block_tables)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        max_blocks = max((len(t) for t in block_tables), default=0) or 1
        flat_table: list[int] = []  # one Python list, one tensor: much cheaper than a tensor per sequence
        slots: list[int] = []
        for i, (blocks, ctx, q) in enumerate(zip(block_tables, context_lens, query_lens)):
            if len(blocks) * block_size < ctx + q:
                raise ValueError(f"sequence {i}: {len(blocks)} blocks cannot hold {ctx + q} tokens")
            flat_table.extend(blocks)
            flat_table.extend([0] * (max_blocks - len(blocks)))
            slots.extend(blocks[pos // block_size] * block_size + pos % block_size for pos in range(ctx, ctx + q))
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        ints = flat_table + seq_lens + context_lens + starts
        staged = _stage(torch.tensor(slots, dtype=torch.int64), torch.tensor(ints, dtype=torch.int32), device)
        slot_mapping, packed = staged
        table_end = num_seqs * max_blocks
        meta = cls(
            slot_mapping=slot_mapping,
            block_tables=packed[:table_end].view(num_seqs, max_blocks),
            seq_lens=packed[table_end : table_end + num_seqs],
            context_lens=packed[table_end + num_seqs : table_end + 2 * num_seqs],
            query_start_loc=packed[table_end + 2 * num_seqs :],
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
        )
        mark_slots_valid(meta.slot_mapping)  # built from block tables: never -1
        return meta


def _stage(slots: torch.Tensor, ints: torch.Tensor, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_mapping int64, packed int32)`` on ``device``, moved there by one host-to-device copy.

    Both live in one int32 buffer (the int64 slots first, two words each, so
    their view is 8-byte aligned). On CUDA the buffer is pinned (torch's caching
    host allocator keeps it alive until the asynchronous copy has read it).
    """
    device = torch.device(device)
    words = 2 * slots.numel()
    if device.type == "cpu":
        return slots, ints
    buffer = torch.empty(words + ints.numel(), dtype=torch.int32, pin_memory=device.type == "cuda")
    buffer[:words].view(torch.int64).copy_(slots)
    buffer[words:].copy_(ints)
    moved = buffer.to(device, non_blocking=True)
    return moved[:words].view(torch.int64), moved[words:]


# slot_mapping tensors known to hold no -1 (skip) entry, so a backend need not look (a device sync on CUDA).
_VALID_SLOTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_slots_valid(slot_mapping: torch.Tensor) -> None:
    """Record that ``slot_mapping`` has no ``-1`` entry (its builder knows; the device need not be asked)."""
    _VALID_SLOTS[slot_mapping] = True


def slots_all_valid(slot_mapping: torch.Tensor) -> bool:
    """Whether every slot is ``>= 0``: from the builder's note when there is one, else by looking (may sync)."""
    return _VALID_SLOTS.get(slot_mapping, False) or bool((slot_mapping >= 0).all())
