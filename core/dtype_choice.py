"""``--dtype auto``: the model dtype from the checkpoint's and what the backend runs fast, decided before loading.

vLLM's rule on CPU: a bf16 or fp16 checkpoint runs in bf16 where the CPU has a fast bf16 path (fp16 becomes
bf16: CPUs have no fast fp16 arithmetic), fp32 otherwise; an fp32 checkpoint stays fp32. The backend says
whether its bf16 path is fast from the CPU's features (its :class:`DtypeFeatures`), never from a timing, so
the same machine always decides the same way. On CUDA the checkpoint's dtype is kept.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

log = logging.getLogger("pagedkv")

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DtypeFeatures:
    """What a backend tells the dtype choice: whether bf16 weights run faster than fp32 on this machine, and
    why (a few words for the log line, e.g. ``"the avx512-bf16 build multiplies bf16 by vdpbf16ps"``)."""

    fast_bf16: bool
    why: str


@runtime_checkable
class HasDtypeFeatures(Protocol):
    """A backend that knows its dtype features before any model is loaded (given to it when it is built)."""

    dtype_features: DtypeFeatures


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    why: str

    def log_line(self) -> str:
        return f"pagedkv: --dtype auto runs {str(self.dtype).replace('torch.', '')}: {self.why}"


def features_of(backend: object) -> DtypeFeatures | None:
    """The backend's dtype features, or None for a backend that declares none (it has no fast bf16 path)."""
    return backend.dtype_features if isinstance(backend, HasDtypeFeatures) else None


def choose_dtype(checkpoint: torch.dtype | str | None, device: str, features: DtypeFeatures | None,
                 quantization: str | None = None) -> DtypeChoice:
    """The model dtype ``--dtype auto`` runs, and why (the decision table is in the module docstring)."""
    if isinstance(checkpoint, str):
        checkpoint = _NAMED.get(checkpoint.replace("torch.", "").lower())
    if quantization:  # the blocks are the weights (GGUF's, or int8/int4 made at load); their kernels take fp32
        label = "GGUF" if quantization == "gguf" else f"{quantization} (quantized at load)"
        return DtypeChoice(torch.float32, f"{label} blocks run with fp32 activations")
    if not isinstance(checkpoint, torch.dtype) or checkpoint not in _NAMED.values():
        return DtypeChoice(torch.float32, "the checkpoint names no dtype")
    name = str(checkpoint).replace("torch.", "")
    if not str(device).startswith("cpu"):
        return DtypeChoice(checkpoint, f"the checkpoint's dtype ({name}) on {device}")
    if checkpoint == torch.float32:
        return DtypeChoice(torch.float32, "the checkpoint is float32")
    if features is None:
        return DtypeChoice(torch.float32, f"{name} checkpoint, but the backend declares no fast bf16 path")
    if not features.fast_bf16:
        return DtypeChoice(torch.float32, f"{name} checkpoint, but no fast bf16 path here: {features.why}")
    as_bf16 = " (float16 becomes bfloat16 on CPU)" if checkpoint == torch.float16 else ""
    return DtypeChoice(torch.bfloat16, f"{name} checkpoint{as_bf16} and a fast bf16 path: {features.why}")
