"""The swap-space protocol: where a preempted sequence's KV blocks wait instead of being recomputed.

A plugin offers one through ``pagedkv_swap_space`` (see ``plugins/cpu_swap.py``). The core
does the device side and the bookkeeping of who is swapped:

- preemption answered ``"swap"``: the scheduler calls :meth:`SwapSpace.swap_out`; if it
  returns a block per device block, the device blocks go back to the pool and the step
  copies ``(device, host)`` pairs out before its forward;
- swap-in: the scheduler calls :meth:`SwapSpace.swap_in`, allocates a device block for
  each returned one and the step copies ``(host, device)`` pairs back;
- the real model runner asks :meth:`SwapSpace.host_kv_caches` once for the tensors the
  copies read and write (a simulated engine never asks, so no bytes are allocated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from pagedkv.core.kv.kv_cache import KVCacheSpec

if TYPE_CHECKING:  # type hints only: this room sits below sched/
    from pagedkv.core.sched.sequence import Sequence


@runtime_checkable
class SwapSpace(Protocol):
    num_blocks: int  # capacity, in blocks of the device cache's layout

    def swap_out(self, seq: Sequence) -> list[int] | None:
        """Reserve one host block per block of ``seq``'s table, in table order; None if they do not fit."""

    def swap_in(self, seq: Sequence) -> list[int]:
        """Give up ``seq``'s host blocks, in table order (their content is copied back this step)."""

    def free(self, seq: Sequence) -> None:
        """``seq`` ended while swapped out: give back its host blocks."""

    def blocks_of(self, seq: Sequence) -> list[int]:
        """``seq``'s host blocks, in table order (empty if it is not swapped out); read-only."""

    def host_kv_caches(self, spec: KVCacheSpec, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(k, v)`` host tensors ``[num_blocks, block_size, kv_heads, head_dim]`` to copy to and from."""
