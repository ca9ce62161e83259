"""The cpu backend's fused Llama layer on GGUF-block weights (``quant_linear.h``'s layer calls), offered to pagedkv's
own Llama as its :class:`~pagedkv.core.model.llama_model.LlamaLayerKernel` when the model's linears are
:class:`~pagedkv.core.model.quant_linear.QuantLinear`: the same two calls as ``llama_layers.py`` (norm, q/k/v and
rotary; o_proj, norm, gate/up, SiLU, down_proj), with each projection read from its blocks (repacked at load) in place
(no second copy: the weights stay the file's size)."""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.core.model.quant_formats import FORMATS
from pagedkv.core.model.quant_linear import QuantLinear


@dataclass(frozen=True, slots=True)
class _QuantPlan:
    """One layer's block pointers and sizes; ``tensors`` are what it was made from (and keep them alive)."""

    tensors: tuple[torch.Tensor, ...]  # the seven blocks, then the two norm weights
    attn_formats: Any  # ctypes int[3] / void*[3]: Wq, Wk, Wv
    attn_weights: Any
    mlp_formats: Any  # ctypes int[4] / void*[4]: Wo, Wg, Wu, Wd
    mlp_weights: Any
    eps: tuple[float, float]
    nq: int
    nkv: int
    head_dim: int
    inter: int


class CpuQuantLlamaLayers:
    """Runs a layer's dense parts on its blocks for fp32 contiguous CPU activations. ``accepts`` checks the layer
    (its seven linears are QuantLinear in a format the kernel takes, fp32 CPU norms) and keeps its plan for the two
    calls that follow."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self._plans: weakref.WeakKeyDictionary[Any, _QuantPlan | None] = weakref.WeakKeyDictionary()
        self._last: tuple[Any, _QuantPlan] | None = None

    def accepts(self, layer: Any, h: torch.Tensor) -> bool:
        self._last = None
        if not (h.dtype == torch.float32 and h.device.type == "cpu" and h.is_contiguous()):
            return False
        current = _tensors(layer)
        plan = self._plans.get(layer)
        if plan is None or current is None or len(plan.tensors) != len(current) or not all(
                a is b for a, b in zip(plan.tensors, current)):
            plan = _make_plan(layer, current) if current is not None else None
            self._plans[layer] = plan
        if plan is not None:
            self._last = (layer, plan)
        return plan is not None

    def attention_inputs(self, layer: Any, h: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        plan = self._plan(layer)
        rows, dim = h.shape[-2], h.shape[-1]
        nq, nkv, head_dim = plan.nq, plan.nkv, plan.head_dim
        qkv = torch.empty((rows, nq + 2 * nkv), dtype=torch.float32)
        xn = torch.empty((min(rows, self._chunk()), dim), dtype=torch.float32)
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = self.lib.pagedkv_cpu_quant_llama_attention_inputs(
            h.data_ptr(), rows, dim, plan.tensors[7].data_ptr(), plan.eps[0], plan.attn_formats, plan.attn_weights,
            nq, nkv, head_dim, cos.data_ptr(), sin.data_ptr(), xn.data_ptr(), qkv.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the cpu quantized layer kernel rejected d={dim}, q={nq}, kv={nkv}, head_dim={head_dim}")
        q = qkv[:, :nq].view(rows, nq // head_dim, head_dim)
        k = qkv[:, nq:nq + nkv].view(rows, nkv // head_dim, head_dim)
        v = qkv[:, nq + nkv:].view(rows, nkv // head_dim, head_dim)
        return q, k, v

    def mlp(self, layer: Any, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        plan = self._plan(layer)
        rows, dim = h.shape[-2], h.shape[-1]
        attn_out = attn_out.reshape(rows, plan.nq)
        if attn_out.dtype != torch.float32 or not attn_out.is_contiguous():
            attn_out = attn_out.float().contiguous()
        scratch = min(rows, self._chunk())
        xn = torch.empty((scratch, dim), dtype=torch.float32)
        gu = torch.empty((scratch, 2 * plan.inter), dtype=torch.float32)
        rc = self.lib.pagedkv_cpu_quant_llama_mlp(
            h.data_ptr(), rows, dim, attn_out.data_ptr(), plan.nq, plan.tensors[8].data_ptr(), plan.eps[1],
            plan.inter, plan.mlp_formats, plan.mlp_weights, xn.data_ptr(), gu.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the cpu quantized layer kernel rejected d={dim}, o={plan.nq}, intermediate={plan.inter}")
        return h

    def _chunk(self) -> int:
        return int(self.lib.pagedkv_cpu_llama_scratch_rows())

    def _plan(self, layer: Any) -> _QuantPlan:
        if self._last is None or self._last[0] is not layer:
            raise ValueError("the cpu quantized layer kernel does not take this layer (see accepts)")
        return self._last[1]


def _linears(layer: Any) -> tuple[Any, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _tensors(layer: Any) -> tuple[torch.Tensor, ...] | None:
    """The layer's seven blocks and two norm weights, or None when the kernel does not take the layer."""
    linears = _linears(layer)
    if not all(isinstance(m, QuantLinear) and m.qtype in FORMATS and m.blocks.device.type == "cpu"
               and m.blocks.is_contiguous() for m in linears):
        return None
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if not all(n.dtype == torch.float32 and n.device.type == "cpu" and n.is_contiguous() for n in norms):
        return None
    return (*(m.blocks for m in linears), *norms)


def _make_plan(layer: Any, tensors: tuple[torch.Tensor, ...]) -> _QuantPlan | None:
    q, k, v, o, g, u, d = _linears(layer)
    head_dim = layer.self_attn.head_dim
    if head_dim % 2 or q.in_features % 32 or o.in_features % 32 or d.in_features % 32:
        return None

    def arrays(mods: tuple[QuantLinear, ...]) -> tuple[Any, Any]:
        return ((ctypes.c_int * len(mods))(*(FORMATS[m.qtype].code for m in mods)),
                (ctypes.c_void_p * len(mods))(*(m.blocks.data_ptr() for m in mods)))

    attn_formats, attn_weights = arrays((q, k, v))
    mlp_formats, mlp_weights = arrays((o, g, u, d))
    eps = (float(layer.input_layernorm.eps), float(layer.post_attention_layernorm.eps))
    return _QuantPlan(tensors, attn_formats, attn_weights, mlp_formats, mlp_weights, eps, q.out_features,
                      k.out_features, head_dim, g.out_features)


def usable(lib: Any) -> bool:
    """Whether ``lib`` has the quantized layer calls (a library built from an older source may not)."""
    return hasattr(lib, "pagedkv_cpu_quant_llama_mlp") and hasattr(lib, "pagedkv_cpu_llama_scratch_rows")
