"""``--quantization int8`` / ``int4``: a full-precision checkpoint's weights quantized at load into the GGUF block
formats pagedkv already multiplies by (:mod:`.quant_formats`), so the cpu kernel and the torch path run them as
they run a GGUF file's blocks.

- ``int8`` -> ``Q8_0``: one fp16 scale per 32 values of a row (8.5 bits a weight). vLLM's W8A16 keeps one scale per
  output channel; a scale per 32-value block is finer (never less accurate) and is the layout the kernels take.
  Activations stay in the model's dtype on the torch path (W8A16); the cpu kernel may quantize them to int8 for
  VNNI dot products as llama.cpp does (W8A8-like).
- ``int4`` -> ``Q4_1``: group-wise scale and minimum per 32 values (5 bits a weight), the asymmetric grouping of
  AWQ/GPTQ's zero points at group size 32. Group 128 would need a block format no kernel here takes: refused.
  The token embedding (and a tied ``lm_head``) is ``Q8_0`` under int4 too: AWQ/GPTQ checkpoints leave them
  unquantized and llama.cpp's Q4 files keep them at 8 bits, because 4-bit logits cost the most accuracy.

The arithmetic matches the ``gguf`` package's reference quantizers (llama.cpp's ``ggml-quants.c``) byte for byte,
in torch, so a model quantized here and the same weights quantized by llama.cpp's tools are one model.
Every ``nn.Linear`` of pagedkv's Llama and its token embedding are quantized (a tied ``lm_head`` shares the
embedding's blocks; an untied one is quantized as the embedding is); norms stay in the model's dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedkv.core.model.quant_formats import BLOCK
from pagedkv.core.model.quant_linear import QuantEmbedding, QuantLinear

log = logging.getLogger("pagedkv.model")

METHOD_FORMATS = {"int8": "Q8_0", "int4": "Q4_1"}  # the linears'
EMBEDDING_FORMAT = "Q8_0"  # the token embedding's and the lm_head's, either method


def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[n, 1]`` float32 -> ``[n, 2]`` uint8: the fp16 value's little-endian bytes."""
    return x.to(torch.float16).view(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``[n, 32]`` values 0..15 -> ``[n, 16]`` bytes: value ``i`` in the low nibble, value ``i + 16`` in the high."""
    return q[:, :16] | (q[:, 16:] << 4)


def quantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, 32]`` float32 -> ``[n, 34]`` ``Q8_0`` blocks (scale ``amax / 127``, values rounded half away from 0)."""
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    scaled = blocks * _inverse(d)
    q = (scaled.sign() * torch.floor(scaled.abs() + 0.5)).to(torch.int8)
    return torch.cat([_half_bytes(d), q.view(torch.uint8)], dim=1)


def quantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """``[n, 32]`` float32 -> ``[n, 20]`` ``Q4_1`` blocks (scale ``(max - min) / 15``, offset ``min``)."""
    hi = blocks.amax(dim=1, keepdim=True)
    lo = blocks.amin(dim=1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.trunc((blocks - lo) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_half_bytes(d), _half_bytes(lo), _pack_nibbles(q)], dim=1)


_QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_1": quantize_q4_1}


def quantize_weight(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """``[out, in]`` weight (``in`` a multiple of 32) -> ``[out, row_bytes]`` uint8 blocks of ``qtype``."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"{qtype} quantizes rows of whole {BLOCK}-value blocks; this weight's rows hold {cols}")
    flat = weight.detach().to(device="cpu", dtype=torch.float32).reshape(-1, BLOCK)
    return _QUANTIZERS[qtype](flat).reshape(rows, -1).contiguous()


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """``model`` (pagedkv's Llama, full precision) with its linears and token embedding in ``method``'s blocks,
    replaced in place; returned for chaining. A weight whose rows are not whole blocks stays as it is (logged)."""
    body = model.model
    embed = body.embed_tokens
    tied = model.lm_head.weight is embed.weight
    kept: list[str] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or (tied and module is model.lm_head):
            continue
        if module.in_features % BLOCK:
            kept.append(name)
            continue
        qtype = EMBEDDING_FORMAT if module is model.lm_head else METHOD_FORMATS[method]
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        blocks = quantize_weight(module.weight, qtype).to(module.weight.device)
        setattr(parent, leaf, QuantLinear(blocks, qtype, module.in_features, module.out_features))
    if embed.embedding_dim % BLOCK == 0:
        blocks = quantize_weight(embed.weight, EMBEDDING_FORMAT).to(embed.weight.device)
        body.embed_tokens = QuantEmbedding(blocks, EMBEDDING_FORMAT, embed.embedding_dim, embed.weight.dtype)
        if tied:
            model.lm_head = body.embed_tokens.as_linear()
    else:
        kept.append("model.embed_tokens" + (" (and the tied lm_head)" if tied else ""))
    if kept:
        log.info("pagedkv: quantization %s: %s kept in %s (rows not whole blocks of %d)", method, ", ".join(kept),
                 embed.weight.dtype, BLOCK)
    return model
