"""pagedkv's own Llama: what transformers' ``LlamaForCausalLM`` computes, op for op, without importing it.

Importing and building transformers' model code was most of start-up. This module
computes the same thing in the same order and dtypes (RMSNorm in float32 then ``weight * x`` in
the input dtype; float32 rotary ``inv_freq`` / cos / sin cast to the activations' dtype;
``rotate_half``; the SiLU-gated MLP; the kept rows before ``lm_head``), so its logits are
bit-identical to transformers' (``tests/core/model/test_llama_model.py``). Attention goes through the same
:func:`~pagedkv.core.model.hf_attention.paged_attention_forward` the transformers path calls, with
tensors of the same shapes and strides. The projections stay ``nn.Linear`` so ``cpu_linear`` packs
them. Which checkpoints take this path: :mod:`pagedkv.core.model.native_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from pagedkv.core.model.hf_attention import paged_attention, paged_attention_forward


@runtime_checkable
class LlamaLayerKernel(Protocol):
    """A backend's fused dense parts of a :class:`DecoderLayer` (the cpu backend's ``llama_block.h``). It reads
    the layer's parameters by their checkpoint names (``self_attn.q_proj.weight``, ...); the attention between
    its two calls stays the engine's (``paged_attention``). Its results equal the op-by-op layer's up to
    rounding, not bit for bit."""

    def accepts(self, layer: DecoderLayer, h: torch.Tensor) -> bool: ...

    def attention_inputs(self, layer: DecoderLayer, h: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def mlp(self, layer: DecoderLayer, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor: ...

    # Optional: ``queries_into_cache(layer, h, cos, sin, k_cache, v_cache, slot_mapping)`` -> q, with the rotated k
    # and the v already written to the layer's paged cache, or None (nothing written) where it cannot.


@runtime_checkable
class HasLlamaLayerKernel(Protocol):
    """An attention backend that also offers the fused layer (None when it has none for this machine)."""

    llama_layer_kernel: LlamaLayerKernel | None


@dataclass
class CausalLMOutput:
    """What the runner reads of a forward: the kept rows' logits ``[1, rows, vocab]``."""

    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotary_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """The default rotary embedding's inverse frequencies, float32 (as transformers builds them), on the CPU
    even under a ``torch.device("meta")`` block (a meta ``arange`` imports torch._dynamo: seconds)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # paged_attention_forward reads it: which layer's KV cache
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Any) -> torch.Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)  # [1, H, T, D]
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        if step is None:  # a plain causal forward (GPU memory profiling, tests): no KV cache involved
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                                             enable_gqa=True).transpose(1, 2)
        else:
            out, _ = paged_attention_forward(self, q, k, v, None, scaling=self.scaling, pagedkv_step=step)
        return self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Any) -> torch.Tensor:
        kernel = None if step is None else step.layer_kernel
        if kernel is not None and kernel.accepts(self, h):
            return kernel.mlp(self, h, self._kernel_attention(kernel, h, cos, sin, step))
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, step)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _kernel_attention(self, kernel: LlamaLayerKernel, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          step: Any) -> torch.Tensor:
        """The attention of the fused layer: a kernel that writes k/v into the paged cache itself
        (``queries_into_cache``, one call instead of two) is asked to first; when it declines, q/k/v go through
        the backend's write and attention as in every other model."""
        attn = self.self_attn
        k_cache, v_cache = step.kv_caches[attn.layer_idx]
        into_cache = getattr(kernel, "queries_into_cache", None)
        q = None if into_cache is None else into_cache(self, h, cos, sin, k_cache, v_cache, step.meta.slot_mapping)
        if q is None:
            q, k, v = kernel.attention_inputs(self, h, cos, sin)
            return paged_attention(attn.layer_idx, q, k, v, attn.scaling, step)
        return step.backend.attend(q, k_cache, v_cache, step.meta, attn.scaling)


class LlamaBody(nn.Module):
    """``model.*`` of the checkpoint: embeddings, layers, final norm (the parameter names match)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        # an explicit (uninitialised) weight: a random normal_ on the meta device imports torch's reference
        # ops (seconds), and the checkpoint replaces the weight anyway
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The engine's model for whitelisted Llama checkpoints; called as the runner calls transformers'."""

    pagedkv_native = True  # known-good: the support probe (which needs transformers) is skipped

    def __init__(self, config: Any, generation_config: Any = None) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = LlamaBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not a buffer: ``.to(dtype)`` must not round it (transformers keeps it float32 too).
        self.inv_freq = rotary_inv_freq(config.rope_parameters["rope_theta"], config.head_dim)

    # Read from the final norm: it stays in the model's dtype when the embeddings are quantized (GGUF, int8/int4).
    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                logits_to_keep: int | torch.Tensor = 0, pagedkv_step: Any = None, **_: Any) -> CausalLMOutput:
        """``input_ids`` / ``position_ids`` ``[1, T]``; logits of the rows ``logits_to_keep`` picks (an int
        keeps the last that many, 0 all; a 1-D tensor the given rows)."""
        h = self.model.embed_tokens(input_ids)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=h.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, pagedkv_step)
        h = self.model.norm(h)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return CausalLMOutput(self.lm_head(h[:, keep, :]))
