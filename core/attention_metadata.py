"""Per-step attention metadata: built once per step, shared by every layer.

All backends read the same object, so its fields are the contract between the
scheduler's decisions and the kernels. Index tensors live on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


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
        """Build the tensors from plain Python lists (one entry per sequence)."""
        if not (len(block_tables) == len(context_lens) == len(query_lens)):
            raise ValueError("block_tables, context_lens and query_lens must have one entry per sequence")
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
        table = torch.tensor(flat_table, dtype=torch.int32).view(len(block_tables), max_blocks)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=table.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=tuple(query_lens),
            seq_lens_cpu=tuple(seq_lens),
        )
