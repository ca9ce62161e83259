"""The cpu backend's fused Llama layer (``llama_block.h``), offered to pagedkv's own Llama as its
:class:`~pagedkv.core.model.llama_model.LlamaLayerKernel`: the layer's dense parts in two calls, around the
attention the engine runs as usual."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.backends.cpu.linear import CpuLinearKernel

# Parameters assigned to any module since import (a replaced weight, e.g. ``layer.q_proj.weight = ...``): reading a
# layer's nine weights through nn.Module attributes is slow next to a step, so plans re-read them only when this
# count moved.
_registrations = [0]


def _count_registration(module: Any, name: str, param: Any) -> None:
    _registrations[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)

_KEPT_SCRATCH_ROWS = 16  # scratch of calls up to this many rows is kept between calls (decode steps)


@dataclass(frozen=True, slots=True)
class _LayerPlan:
    """One layer's packed weights and the sizes and pointers of its two kernel calls."""

    generation: int  # _registrations when it was made
    tensors: tuple[torch.Tensor, ...]  # the layer's weights it was made from, and their keys
    key: tuple  # _marks of the tensors
    packs: tuple[torch.Tensor, ...]  # [Wq; Wk; Wv], Wo, [Wg; Wu], Wd, the fp32 norm weights (kept for the pointers)
    pointers: tuple[int, ...]  # the four packs', then the two norm weights'
    eps: tuple[float, float]
    nq: int
    nkv: int
    head_dim: int
    inter: int
    dtype: torch.dtype = torch.float32  # the weights' (and the activations' it takes)
    scratch: int = 0  # floats of the attention call's scratch a row


class CpuLlamaLayers:
    """Packs each layer's ``[Wq; Wk; Wv]``, ``Wo``, ``[Wg; Wu]`` and ``Wd`` once (again if a weight is replaced or
    changed in place) and runs the layer's attention inputs and MLP block on CPU activations of the weights' dtype:
    fp32, or bf16 where the library has the bf16 panels (the kernel widens bf16 activations to fp32 and rounds its
    results to bf16 once, as torch's conversions around an fp32 call would).

    ``accepts`` checks the layer's weights (a few dozen attribute reads) and keeps the layer's plan; the two calls
    that follow it for the same layer use that plan without checking again (once per layer and step, not three
    times: the checks are a measurable share of a small model's step, docs/cpu_kernels.md)."""

    def __init__(self, lib: Any, linear: CpuLinearKernel) -> None:
        self.lib = lib
        self.linear = linear
        self._dtypes = (torch.float32, torch.bfloat16) if hasattr(lib, "pagedkv_cpu_llama_mlp_bf16") else (
            torch.float32,)
        self._plans: weakref.WeakKeyDictionary[Any, _LayerPlan] = weakref.WeakKeyDictionary()
        self._last: tuple[Any, _LayerPlan] | None = None  # (layer, plan) of the last accepts
        # Per-call Python is a measurable share of a batch-1 step (two calls a layer of ~25-100 us, next to ~1 us
        # a torch call): the calls' scratch is kept by shape (the kernel only writes and reads it within a call),
        # the chunk of rows read once, the cache pairs checked once, the step's cos/sin and slots once a step (all
        # by identity).
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}
        self._chunk = lib.pagedkv_cpu_llama_scratch_rows() if hasattr(lib, "pagedkv_cpu_llama_scratch_rows") else 0
        self._caches: dict[int, tuple[weakref.ref, weakref.ref, int | None, int]] = {}
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's cos/sin, as the kernel takes them
        self._slots: tuple[torch.Tensor, int] | None = None  # the step's slot mapping and rows, checked

    def accepts(self, layer: Any, h: torch.Tensor) -> bool:
        """Contiguous CPU activations and CPU weights without biases, all fp32 or all bf16 (what the kernel
        computes)."""
        if not (h.dtype in self._dtypes and h.device.type == "cpu" and h.is_contiguous()):
            return False
        plan = self._checked_plan(layer)
        if plan is not None and plan.dtype != h.dtype:
            plan = None
        self._last = None if plan is None else (layer, plan)
        return plan is not None

    def attention_inputs(self, layer: Any, h: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h`` ``[1, T, D]`` -> rotated q ``[T, H, hd]``, rotated k and v ``[T, Hkv, hd]`` (views of one buffer)."""
        plan = self._plan(layer)
        rows, nq, nkv, head_dim = h.shape[-2], plan.nq, plan.nkv, plan.head_dim
        qkv = torch.empty((rows, nq + 2 * nkv), dtype=plan.dtype)
        self._attention_call(plan, h, cos, sin, qkv, 0, 0, 0, 0)
        heads, kv_heads = nq // head_dim, nkv // head_dim
        q, k, v = qkv.view(rows, heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=1)
        return q, k, v

    def queries_into_cache(self, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """:meth:`attention_inputs` with the rotated k and the v written straight into their slots of the layer's
        paged cache (what the backend's ``write_kv`` would do next, without its call and checks: ~10 us a layer of
        a ~25 us batch-1 bf16 layer call); returns q ``[T, H, hd]``, or None (nothing written) where the cache is
        not one of the activations' dtype, contiguous, CPU, of the layer's KV width, or a slot is past its end:
        the caller then writes through the backend, whose reference raises for such a slot."""
        plan = self._plan(layer)
        rows, slots = h.shape[-2], self._cache_slots(plan, k_cache, v_cache)
        if slots is None or not self._slots_fit(slot_mapping, rows):
            return None
        q = torch.empty((rows, plan.nq // plan.head_dim, plan.head_dim), dtype=plan.dtype)
        if self._attention_call(plan, h, cos, sin, q, k_cache.data_ptr(), v_cache.data_ptr(),
                                slot_mapping.data_ptr(), slots) != 0:
            return None
        return q

    def mlp(self, layer: Any, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """``h`` += o_proj(attention output), then += the MLP of its post-attention norm; ``h`` is updated in place
        and returned."""
        plan = self._plan(layer)
        rows, dim = h.shape[-2], h.shape[-1]
        nq, inter = plan.nq, plan.inter
        attn_out = attn_out.reshape(rows, nq)
        if attn_out.dtype != plan.dtype or not attn_out.is_contiguous():
            attn_out = attn_out.to(plan.dtype).contiguous()
        # one scratch buffer (held until the call returns): xn [chunk, dim], gu [chunk, 2 inter], and for bf16 wide
        # [chunk, dim + nq] (h and attn widened inside)
        chunk, bf16 = self._scratch_rows(rows), plan.dtype == torch.bfloat16
        buffer = self._buffer(chunk, 2 * dim + 2 * inter + nq if bf16 else dim + 2 * inter)
        scratch = buffer.data_ptr()
        wqkv, wo, wgu, wdown, _, norm = plan.pointers
        args = (h.data_ptr(), rows, dim, attn_out.data_ptr(), nq, wo, norm, plan.eps[1], wgu, inter, wdown,
                scratch, scratch + 4 * chunk * dim)
        if bf16:
            rc = self.lib.pagedkv_cpu_llama_mlp_bf16_act(*args, scratch + 4 * chunk * (dim + 2 * inter),
                                                         torch.get_num_threads())
        else:
            rc = self.lib.pagedkv_cpu_llama_mlp(*args, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the cpu Llama layer kernel rejected d={dim}, o={nq}, intermediate={inter}")
        return h

    def _attention_call(self, plan: _LayerPlan, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        out: torch.Tensor, k_cache: int, v_cache: int, slots: int, num_slots: int) -> int:
        """One attention-inputs call on activations of the weights' dtype (``k_cache`` 0: q, k, v into ``out``);
        raises for sizes the kernel does not take, returns its code otherwise (2: a slot past ``num_slots``)."""
        rows, dim = h.shape[-2], h.shape[-1]
        if self._tables is None or self._tables[0] is not cos or self._tables[1] is not sin:  # (once a step)
            if cos.dtype != plan.dtype or not cos.is_contiguous():  # (the model makes them so: no copy)
                cos = cos.to(plan.dtype).contiguous()
            if sin.dtype != plan.dtype or not sin.is_contiguous():
                sin = sin.to(plan.dtype).contiguous()
            else:
                self._tables = (cos, sin)  # (both as given: a step's layers pass the same pair)
        call = (self.lib.pagedkv_cpu_llama_attention_kv_bf16 if plan.dtype == torch.bfloat16
                else self.lib.pagedkv_cpu_llama_attention_kv)
        scratch = self._buffer(self._scratch_rows(rows), plan.scratch)
        rc = call(h.data_ptr(), rows, dim, plan.pointers[4], plan.eps[0], plan.pointers[0], plan.nq, plan.nkv,
                  plan.head_dim, cos.data_ptr(), sin.data_ptr(), scratch.data_ptr(), out.data_ptr(), k_cache, v_cache,
                  slots, num_slots, torch.get_num_threads())
        if rc == 1:
            raise ValueError(f"the cpu Llama layer kernel rejected d={dim}, q={plan.nq}, kv={plan.nkv}, "
                             f"head_dim={plan.head_dim}")
        return rc

    def _slots_fit(self, slot_mapping: torch.Tensor, rows: int) -> bool:
        """int64, contiguous, CPU, one slot a row (checked once a step: every layer gets the step's slots)."""
        if self._slots is not None and self._slots[0] is slot_mapping and self._slots[1] == rows:
            return True
        fits = (slot_mapping.dtype == torch.int64 and slot_mapping.device.type == "cpu"
                and slot_mapping.is_contiguous() and slot_mapping.shape == (rows,))
        self._slots = (slot_mapping, rows) if fits else None
        return fits

    def _cache_slots(self, plan: _LayerPlan, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int | None:
        """Slots of a cache pair the kernel writes for ``plan`` (checked once per pair), or None."""
        known = self._caches.get(id(k_cache))  # (weak references: a cache the engine drops is not kept alive)
        if known is None or known[0]() is not k_cache or known[1]() is not v_cache:
            fits = (k_cache.dtype == v_cache.dtype == plan.dtype and k_cache.device.type == v_cache.device.type == "cpu"
                    and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dim() == 4
                    and k_cache.shape == v_cache.shape)
            slots = k_cache.shape[0] * k_cache.shape[1] if fits else None
            if len(self._caches) > 4096:  # (ids of dropped caches: forget them all now and then)
                self._caches.clear()
            known = self._caches[id(k_cache)] = (weakref.ref(k_cache), weakref.ref(v_cache), slots,
                                                 k_cache.shape[2] * k_cache.shape[3] if k_cache.dim() == 4 else -1)
        return known[2] if known[3] == plan.nkv else None

    def _buffer(self, rows: int, cols: int) -> torch.Tensor:
        """An fp32 ``[rows, cols]`` scratch tensor: for a decode step's few rows the same one for every call of that
        shape (a bounded set), otherwise a new one."""
        if rows > _KEPT_SCRATCH_ROWS:
            return torch.empty((rows, cols), dtype=torch.float32)
        buf = self._scratch.get((rows, cols))
        if buf is None:
            buf = self._scratch[(rows, cols)] = torch.empty((rows, cols), dtype=torch.float32)
        return buf

    def _scratch_rows(self, rows: int) -> int:
        """Rows of scratch a call needs: the kernel goes through a long input a chunk of rows at a time (a library
        built before that, bound for A/B runs, needs all of them)."""
        return min(rows, self._chunk or rows)

    def _plan(self, layer: Any) -> _LayerPlan:
        last = self._last
        if last is not None and last[0] is layer:
            return last[1]
        plan = self._checked_plan(layer)
        if plan is None:
            raise ValueError("the cpu Llama layer kernel does not take this layer (see accepts)")
        return plan

    def _checked_plan(self, layer: Any) -> _LayerPlan | None:
        plan = self._plans.get(layer)
        if plan is None or plan.generation != _registrations[0] or not _unchanged(plan):  # a parameter was
            plan = self._make_plan(layer)  # assigned since, or a weight's contents changed
        return plan if plan.packs else None

    def _make_plan(self, layer: Any) -> _LayerPlan:
        """The layer's plan (without packs when the kernel does not take it)."""
        generation = _registrations[0]
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        tensors = [m.weight for m in linears] + [n.weight for n in norms]
        key = _marks(tensors)
        plan = _LayerPlan(generation, tuple(tensors), key, (), (), (0.0, 0.0), 0, 0, 0, 0)
        dtype = tensors[0].dtype
        usable = (dtype in self._dtypes and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)
                  and all(m.bias is None for m in linears) and attn.head_dim % 2 == 0)
        if usable:
            with torch.no_grad():
                q, k, v, o, g, u, d = (m.weight.detach() for m in linears)
                packs = (self.linear.pack(torch.cat([q, k, v])), self.linear.pack(o),
                         self.linear.pack(torch.cat([g, u])), self.linear.pack(d),
                         *(n.weight.detach().float().contiguous() for n in norms))  # (fp32 weights: no copy)
            pointers = tuple(t.data_ptr() for t in packs)
            plan = _LayerPlan(generation, tuple(tensors), key, packs, pointers,
                              (float(norms[0].eps), float(norms[1].eps)), attn.q_proj.out_features,
                              attn.k_proj.out_features, attn.head_dim,
                              mlp.gate_proj.out_features, dtype,
                              self.lib.pagedkv_cpu_llama_attention_scratch(attn.q_proj.in_features, sum(
                                  m.out_features for m in linears[:3]), attn.head_dim))
        self._plans[layer] = plan
        return plan


def _marks(tensors: list[torch.Tensor]) -> tuple[tuple[int, int | None], ...]:
    """What shows that a weight changed between steps: its storage, and its in-place version where torch tracks one
    (not for inference tensors). A cheaper ``weight_key`` (a new dtype, shape or stride comes with new storage):
    checked for every layer of every step, the full key was ~0.5 ms of a 13 ms bf16 SmolLM2 step."""
    return tuple((t.data_ptr(), None if t.is_inference() else t._version) for t in tensors)


def _unchanged(plan: _LayerPlan) -> bool:
    for t, (pointer, version) in zip(plan.tensors, plan.key):
        if t.data_ptr() != pointer or (version is not None and t._version != version):
            return False
    return True


def usable(lib: Any) -> bool:
    """Whether ``lib`` has the fused layer (a library built from an older source may not)."""
    return hasattr(lib, "pagedkv_cpu_llama_attention_kv")
