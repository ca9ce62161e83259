"""The attention backend interface that every backend implements.

One KV layout for all backends: per layer, ``k_cache`` and ``v_cache`` are each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Packed tensors are
``[num_tokens, heads, head_dim]``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from pagedkv.core.kv.attention_metadata import AttentionMetadata


def check_window(window: int | None) -> None:
    """The one error for a sliding window no backend can honour (see ``AttentionBackend.attend``)."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 or None, got {window}")


@runtime_checkable
class AttentionBackend(Protocol):
    """Operations the model runner needs from an attention backend."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter ``key``/``value`` rows ``[T, Hkv, D]`` into their slots; slot -1 is skipped."""

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal paged attention of packed ``query`` ``[T, H, D]``; returns ``[T, H, D]``.

        Keys come only from the cache (written before this call), so decodes
        and prefill chunks with earlier context are handled the same way.

        ``window`` (sliding-window attention, per layer): a query at absolute
        position ``p`` sees only keys at positions ``p - window < k <= p``, i.e.
        the last ``window`` tokens including itself (transformers'
        ``sliding_window`` semantics). ``None`` means full causal attention.
        Keys outside the window stay in the cache; they are just not attended.

        ``softcap`` (Gemma 2's ``attn_logit_softcapping``): every score
        ``s = scale * q.k`` becomes ``softcap * tanh(s / softcap)`` before the
        mask and the softmax. ``None`` means no capping.
        """

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
        """For every layer, copy block ``pairs[i, 0]`` onto block ``pairs[i, 1]`` (int64 ``[N, 2]``)."""

    def swap_blocks(
        self,
        src: list[tuple[torch.Tensor, torch.Tensor]],
        dst: list[tuple[torch.Tensor, torch.Tensor]],
        pairs: torch.Tensor,
    ) -> None:
        """Copy blocks between two caches (e.g. device and CPU): ``src[pairs[i,0]] -> dst[pairs[i,1]]``."""
