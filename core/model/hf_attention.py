"""The bridge into transformers: our attention function, called by every layer.

transformers looks the function up by name (``AttentionInterface``) and passes
any extra kwarg of ``model(...)`` through unchanged; the step's
:class:`StepContext` rides along as ``pagedkv_step``. A layer's sliding
window and softcap arrive as the ``sliding_window`` / ``softcap`` kwargs and
go to the backend per call. A mask function is
registered under the same name and returns no mask, because the backend builds
its own causal mask from the metadata. pagedkv's own Llama (``llama_model``) calls
:func:`paged_attention_forward` directly, with the same tensors, and registers nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.core.kv.attention_metadata import AttentionMetadata

ATTENTION_NAME = "pagedkv"


@dataclass
class StepContext:
    """Everything a layer needs for one step."""

    meta: AttentionMetadata
    backend: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    layer_kernel: Any = None  # pagedkv's own Llama: the backend's LlamaLayerKernel, if it offers one


def paged_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    step: StepContext, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One layer's attention on packed ``q`` ``[T, H, D]`` and new ``k``/``v`` ``[T, Hkv, D]``: write them to the
    layer's cache, attend through it; ``[T, H, D]``."""
    k_cache, v_cache = step.kv_caches[layer_idx]
    step.backend.write_kv(k, v, k_cache, v_cache, step.meta.slot_mapping)
    if window is None and softcap is None:
        return step.backend.attend(q, k_cache, v_cache, step.meta, scale)
    return step.backend.attend(q, k_cache, v_cache, step.meta, scale, window=window, softcap=softcap)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]`` -> ``[1, T, H, D]``."""
    step: StepContext | None = kwargs.get("pagedkv_step")
    if step is None:
        raise RuntimeError("the pagedkv attention was called without a step context; run the model via pagedkv")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(q.shape[-1])
    # transformers tells each layer its own window (Gemma 2/3 alternate) and softcap; check_model_support
    # made sure at load that these agree with the config, so they are exactly what its masks would do.
    out = paged_attention(module.layer_idx, q, k, v, scale, step, kwargs.get("sliding_window"), kwargs.get("softcap"))
    return out.unsqueeze(0), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register_attention() -> None:
    """Make ``attn_implementation="pagedkv"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
