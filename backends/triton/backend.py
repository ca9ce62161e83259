"""The Triton attention backend: KV write, paged attention (mixed batch and split-KV decode), block copy.

On a CUDA device the kernels are compiled for the GPU. On the CPU they run
through Triton's interpreter, which executes every program in Python: correct,
very slow, meant for checking. Triton chooses interpreter or compiler when a
kernel is *defined* (``@triton.jit`` reads ``TRITON_INTERPRET`` at import), so:

- for a CPU device, if ``TRITON_INTERPRET`` is unset and no kernel module of
  this package has been imported yet, the backend sets ``TRITON_INTERPRET=1``
  itself (process-wide) and then imports its kernels, so ``--backend triton``
  just works on a CPU-only machine. This holds even when ``triton`` itself was
  imported earlier (transformers does so while building a model): the kernels
  call only triton.language builtins, never its compiled-mode @jit helpers
  (see ``attn_tile.py``);
- if the kernels were already imported compiled, or ``TRITON_INTERPRET`` is
  set to something other than ``1``, it raises a ``RuntimeError`` telling the
  user to set ``TRITON_INTERPRET=1`` before starting the process.

Kernel modules are imported only in ``__init__``, never at module import.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch

from pagedkv.backends.torch_ref.attention import swap_blocks as reference_swap_blocks
from pagedkv.core.kv.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)

_PACKAGE = "pagedkv.backends.triton"
_KERNEL_MODULES = ("write_kv", "attn_tile", "paged_attention", "split_kv_decode", "copy_blocks")
INTERPRETER_NOTICE = (
    "triton backend on CPU: kernels run through Triton's interpreter (TRITON_INTERPRET=1), "
    "which is very slow and meant for checking correctness, not for serving"
)


def _kernels_imported() -> list[str]:
    return [name for name in _KERNEL_MODULES if f"{_PACKAGE}.{name}" in sys.modules]


def _select_triton_mode(device: torch.device) -> None:
    """Make sure the kernels will be defined for the right mode before they are imported."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"triton backend: device {device} requested but no CUDA device is available; "
                "use device 'cpu' (runs through Triton's interpreter) or another backend"
            )
        return
    if device.type != "cpu":
        raise ValueError(f"triton backend: unsupported device {device} (use 'cuda' or 'cpu')")
    setting = os.environ.get("TRITON_INTERPRET")
    if setting is None and not _kernels_imported():
        os.environ["TRITON_INTERPRET"] = "1"
    elif setting != "1":
        raise RuntimeError(
            "triton backend on CPU needs Triton's interpreter: set TRITON_INTERPRET=1 in the environment "
            "before starting (kernels are chosen for the interpreter or the GPU when they are first imported)"
        )


class TritonBackend:
    """Triton kernels behind the :class:`~pagedkv.backends.base.AttentionBackend` interface.

    ``force_num_splits`` overrides the split-KV heuristic for decode-only steps
    (``1`` disables split-KV); ``None`` lets :func:`choose_num_splits` decide.
    """

    name = "triton"

    def __init__(self, config: Any) -> None:
        self.device = torch.device(getattr(config, "device", "cpu"))
        self.dtype = getattr(config, "dtype", None)
        self.block_size = getattr(config, "block_size", None)
        self.force_num_splits: int | None = None
        _select_triton_mode(self.device)

        from triton.runtime.interpreter import InterpretedFunction

        from pagedkv.backends.triton import copy_blocks, paged_attention, split_kv_decode, write_kv

        self._write_kv = write_kv
        self._paged = paged_attention
        self._split = split_kv_decode
        self._copy = copy_blocks
        self.interpreted = isinstance(write_kv._write_kv_kernel, InterpretedFunction)
        if self.device.type == "cpu" and not self.interpreted:
            raise RuntimeError(
                "triton backend on CPU: the Triton kernels were already imported for the GPU; "
                "set TRITON_INTERPRET=1 in the environment before starting the process"
            )
        if self.interpreted:
            log.warning(INTERPRETER_NOTICE)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        self._write_kv.write_kv(key, value, k_cache, v_cache, slot_mapping)

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
        if meta.is_decode_only and meta.num_tokens == meta.num_seqs:
            num_splits = self.force_num_splits
            if num_splits is None:
                covered = min(meta.max_seq_len, window) if window else meta.max_seq_len
                num_splits = self._split.choose_num_splits(meta.num_seqs, k_cache.shape[2], covered)
            if num_splits > 1:
                return self._split.split_kv_decode(
                    query,
                    k_cache,
                    v_cache,
                    meta.block_tables,
                    meta.seq_lens,
                    meta.query_start_loc,
                    meta.max_seq_len,
                    scale,
                    num_splits,
                    window=window,
                    softcap=softcap,
                )
        return self._paged.paged_attention(
            query,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.context_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            window=window,
            softcap=softcap,
        )

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
        self._copy.copy_blocks(kv_caches, pairs)

    def swap_blocks(
        self,
        src: list[tuple[torch.Tensor, torch.Tensor]],
        dst: list[tuple[torch.Tensor, torch.Tensor]],
        pairs: torch.Tensor,
    ) -> None:
        """Device <-> CPU block copies: a transfer, no kernel to write, so the reference does it."""
        reference_swap_blocks(src, dst, pairs)
