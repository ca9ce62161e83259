"""The cpu backend's fused Llama layer (``llama_block.h``), offered to pagedkv's own Llama as its
:class:`~pagedkv.core.model.llama_model.LlamaLayerKernel`: the layer's dense parts in two calls, around the
attention the engine runs as usual."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from pagedkv.backends.cpu.linear import CpuLinearKernel


class CpuLlamaLayers:
    """Packs each layer's ``[Wq; Wk; Wv]``, ``Wo``, ``[Wg; Wu]`` and ``Wd`` once (again if a weight is replaced or
    changed in place) and runs the layer's attention inputs and MLP block on fp32 CPU activations."""

    def __init__(self, lib: Any, linear: CpuLinearKernel) -> None:
        self.lib = lib
        self.linear = linear
        self._packs: weakref.WeakKeyDictionary[Any, tuple[tuple, tuple[torch.Tensor, ...]]] = (
            weakref.WeakKeyDictionary())

    def accepts(self, layer: Any, h: torch.Tensor) -> bool:
        """fp32 contiguous CPU activations and fp32 CPU weights without biases (what the kernel computes)."""
        return (h.dtype == torch.float32 and h.device.type == "cpu" and h.is_contiguous()
                and self._layer_packs(layer) is not None)

    def attention_inputs(self, layer: Any, h: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h`` ``[1, T, D]`` -> rotated q ``[T, H, hd]``, rotated k and v ``[T, Hkv, hd]`` (views of one buffer)."""
        attn = layer.self_attn
        wqkv = self._layer_packs(layer)[0]
        rows, dim = h.shape[-2], h.shape[-1]
        head_dim = attn.head_dim
        nq, nkv = attn.q_proj.out_features, attn.k_proj.out_features
        qkv = torch.empty((rows, nq + 2 * nkv), dtype=torch.float32)
        xn = torch.empty((rows, dim), dtype=torch.float32)
        cos, sin = cos.contiguous(), sin.contiguous()
        norm = layer.input_layernorm
        rc = self.lib.pagedkv_cpu_llama_attention_inputs(
            h.data_ptr(), rows, dim, norm.weight.data_ptr(), float(norm.eps), wqkv.data_ptr(), nq, nkv, head_dim,
            cos.data_ptr(), sin.data_ptr(), xn.data_ptr(), qkv.data_ptr(), torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"the cpu Llama layer kernel rejected d={dim}, q={nq}, kv={nkv}, head_dim={head_dim}")
        q = qkv[:, :nq].view(rows, nq // head_dim, head_dim)
        k = qkv[:, nq:nq + nkv].view(rows, nkv // head_dim, head_dim)
        v = qkv[:, nq + nkv:].view(rows, nkv // head_dim, head_dim)
        return q, k, v

    def mlp(self, layer: Any, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """``h`` += o_proj(attention output), then += the MLP of its post-attention norm; ``h`` is updated in place
        and returned."""
        _, wo, wgu, wdown = self._layer_packs(layer)
        rows, dim = h.shape[-2], h.shape[-1]
        nq = layer.self_attn.o_proj.in_features
        inter = layer.mlp.gate_proj.out_features
        attn_out = attn_out.reshape(rows, nq)
        if attn_out.dtype != torch.float32 or not attn_out.is_contiguous():
            attn_out = attn_out.float().contiguous()
        xn = torch.empty((rows, dim), dtype=torch.float32)
        gu = torch.empty((rows, 2 * inter), dtype=torch.float32)
        norm = layer.post_attention_layernorm
        rc = self.lib.pagedkv_cpu_llama_mlp(
            h.data_ptr(), rows, dim, attn_out.data_ptr(), nq, wo.data_ptr(), norm.weight.data_ptr(), float(norm.eps),
            wgu.data_ptr(), inter, wdown.data_ptr(), xn.data_ptr(), gu.data_ptr(), torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"the cpu Llama layer kernel rejected d={dim}, o={nq}, intermediate={inter}")
        return h

    def _layer_packs(self, layer: Any) -> tuple[torch.Tensor, ...] | None:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        tensors = [m.weight for m in linears] + [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        key = tuple(_weight_key(t) for t in tensors)
        cached = self._packs.get(layer)
        if cached is not None and cached[0] == key:
            return cached[1] or None
        packs: tuple[torch.Tensor, ...] = ()
        usable = (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
                  and all(m.bias is None for m in linears) and attn.head_dim % 2 == 0)
        if usable:
            with torch.no_grad():
                q, k, v, o, g, u, d = (m.weight.detach() for m in linears)
                packs = (self.linear.pack(torch.cat([q, k, v])), self.linear.pack(o),
                         self.linear.pack(torch.cat([g, u])), self.linear.pack(d))
        self._packs[layer] = (key, packs)
        return packs or None


def _weight_key(t: torch.Tensor) -> tuple:
    """What identifies a weight's contents: storage, dtype, shape, and the in-place version (``load_state_dict``
    and tensor-parallel sharding copy into the existing parameter, which a pointer alone would not notice)."""
    return t.data_ptr(), t.dtype, t.device, tuple(t.shape), None if t.is_inference() else t._version


def usable(lib: Any) -> bool:
    """Whether ``lib`` has the fused layer (a library built from an older source may not)."""
    return hasattr(lib, "pagedkv_cpu_llama_mlp")
