"""Linear and embedding layers whose weights stay in a GGUF block format (:mod:`.quant_formats`).

A 4-bit model held as fp32 reads ~7x the bytes its file holds in every decode step, and decode at small batch is
bound by those bytes. :class:`QuantLinear` keeps the file's blocks (a ``uint8`` buffer, repacked once at load in
:mod:`.quant_packing`'s layout: the same bytes, moved so a kernel reads them aligned) and multiplies by them:

- inside :func:`quantized_linears` with a backend's :class:`QuantKernel` (the cpu backend's ``quant_linear.h``
  de-quantizes in registers), for the inputs and formats that kernel takes;
- anywhere else (every other backend, dtype and device) by de-quantizing the whole weight to the input's dtype and
  calling ``F.linear``: correct, not fast, and it holds the full-precision weight only for the one call.

:class:`QuantEmbedding` de-quantizes only the rows a step looks up. The tied ``lm_head`` of a model whose
embeddings are quantized is a :class:`QuantLinear` over the same blocks (one copy).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from pagedkv.core.model.quant_formats import FORMATS, dequantize, row_bytes
from pagedkv.core.model.quant_packing import pack, packed_rows, unpack


@runtime_checkable
class QuantKernel(Protocol):
    """A backend's ``y = x W^T`` for fp32 CPU ``x`` and a weight in GGUF blocks ``[out, row_bytes]``, repacked
    (:func:`~.quant_packing.pack`)."""

    def supports(self, qtype: str) -> bool: ...

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, qtype: str, out_features: int) -> torch.Tensor: ...


@runtime_checkable
class HasQuantKernel(Protocol):
    """An attention backend that also offers the quantized linear (None when it has none for this machine)."""

    quant_kernel: QuantKernel | None


@runtime_checkable
class HasQuantLayerKernel(Protocol):
    """An attention backend with a fused Llama layer for layers whose linears are :class:`QuantLinear` (a
    :class:`~pagedkv.core.model.llama_model.LlamaLayerKernel`; None when it has none for this machine)."""

    quant_layer_kernel: Any


_ACTIVE: ContextVar[QuantKernel | None] = ContextVar("pagedkv_quant_kernel", default=None)


@contextmanager
def quantized_linears(kernel: QuantKernel | None) -> Iterator[None]:
    """Within this block (and this context), :class:`QuantLinear` layers multiply through ``kernel`` where it
    takes the input; None: the de-quantize-then-matmul path everywhere."""
    token = _ACTIVE.set(kernel)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class QuantLinear(nn.Module):
    """``y = x W^T`` (no bias) with ``W`` ``[out_features, in_features]`` held as ``qtype`` blocks: ``blocks`` in
    the file's layout, repacked here, or already repacked (``packed``; a tied head shares its embedding's)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, in_features: int, out_features: int,
                 packed: bool = False) -> None:
        super().__init__()
        if qtype not in FORMATS:
            raise ValueError(f"no quantized linear for {qtype}; formats: {sorted(FORMATS)}")
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (out_features, row_bytes(qtype, in_features)):
            raise ValueError(f"{qtype} blocks of a {out_features} x {in_features} weight are uint8 "
                             f"[{out_features}, {row_bytes(qtype, in_features)}], got {blocks.dtype} "
                             f"{list(blocks.shape)}")
        self.register_buffer("blocks", blocks if packed else pack(blocks, qtype, in_features))
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}"

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]`` in ``dtype``."""
        return dequantize(unpack(self.blocks, self.qtype, self.in_features), self.qtype, self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = _ACTIVE.get()
        if (kernel is not None and x.dtype == torch.float32 and x.device.type == "cpu"
                and self.blocks.device.type == "cpu" and kernel.supports(self.qtype)):
            return kernel.linear(x, self.blocks, self.qtype, self.out_features)
        return nn.functional.linear(x, self.dequantized(x.dtype))


class QuantEmbedding(nn.Module):
    """Embedding lookup on ``qtype`` blocks ``[num_embeddings, row_bytes]`` (the file's layout, held repacked as
    :class:`QuantLinear` holds them, so a tied head shares them): only the looked-up rows are de-quantized."""

    def __init__(self, blocks: torch.Tensor, qtype: str, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("blocks", pack(blocks, qtype, embedding_dim))
        self.qtype = qtype
        self.embedding_dim = embedding_dim
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = packed_rows(self.blocks, self.qtype, self.embedding_dim, ids.reshape(-1))
        return dequantize(rows, self.qtype, self.embedding_dim, self.dtype).reshape(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantLinear:
        """The tied output projection over the same blocks (no copy)."""
        return QuantLinear(self.blocks, self.qtype, self.embedding_dim, self.blocks.shape[0], packed=True)


def has_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds any :class:`QuantLinear` (a backend's fused fp32 layer cannot take it)."""
    return any(isinstance(m, QuantLinear) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage counted once (tied weights, shared blocks)."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def weight_formats(model: nn.Module) -> list[str]:
    """The block formats ``model``'s weights are held in (sorted; empty for a full-precision model)."""
    return sorted({m.qtype for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))})


def weights_text(model: nn.Module) -> str:
    """``model``'s resident weights in words for the capacity line: ``weights 96.6 MiB (Q4_1, Q8_0 blocks)``."""
    size = weight_bytes(model)
    formats = weight_formats(model)
    dtype = next((t.dtype for t in model.parameters() if t.is_floating_point()), None)
    held = f"{', '.join(formats)} blocks" if formats else str(dtype).replace("torch.", "")
    size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    return f"weights {size_text} ({held})"
