"""The CPU backend: paged attention by a small compiled kernel, cache ops from the reference, and the model's fp32
linears by the same library (``linear.h``)."""

from __future__ import annotations

import torch

from pagedkv.backends.base import check_window
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.dtype_features import cpu_dtype_features
from pagedkv.backends.cpu.linear import CpuLinearKernel, usable
from pagedkv.backends.cpu.llama_layers import CpuLlamaLayers
from pagedkv.backends.cpu.llama_layers import usable as layers_usable
from pagedkv.backends.cpu.quant_layers import CpuQuantLlamaLayers
from pagedkv.backends.cpu.quant_layers import usable as quant_layers_usable
from pagedkv.backends.cpu.quant_linear import CpuQuantKernel
from pagedkv.backends.cpu.quant_linear import usable as quant_usable
from pagedkv.backends.cpu.route_table import KERNEL, TORCH, Routes
from pagedkv.backends.cpu.torch_prefill import attend_prefills
from pagedkv.backends.torch_ref import TorchBackend
from pagedkv.core.dtype_choice import DtypeFeatures
from pagedkv.core.kv.attention_metadata import AttentionMetadata

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
REFERENCE_DTYPES = (torch.float16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)  # no kernel path (yet)
# Query tokens per work unit in a prefill chunk: with the group's heads, 16 x G query rows
# share every K/V block the unit reads and every K chunk it transposes; larger tiles leave a
# small prompt too few units for the threads (measured: docs/cpu_kernels.md).
QUERY_TILE = 16


class CpuBackend(TorchBackend):
    """Reads K/V blocks in place through the block table; GQA groups share each K/V row. Writing the
    cache and the block copies/swaps are the reference's (inherited). A phase whose kernel path is
    slower than torch's on this CPU (``routes``, decided by routes.py when the plugin builds it) goes to torch
    instead; without ``routes`` every phase runs the kernel."""

    name = "cpu"

    def __init__(self, lib=None, routes: Routes | None = None,  # noqa: ANN001 - a ctypes library
                 dtype_features: DtypeFeatures | None = None) -> None:
        super().__init__("cpu")
        self.lib = lib if lib is not None else build.load()
        self.routes = routes if routes is not None else Routes()
        # the model runner's fp32 linears (pagedkv.core.model.cpu_linear.HasLinearKernel)
        self.linear_kernel = CpuLinearKernel(self.lib) if self.routes.linear == KERNEL and usable(self.lib) else None
        # pagedkv's own Llama: its layers' dense parts (pagedkv.core.model.llama_model.HasLlamaLayerKernel)
        self.llama_layer_kernel = (CpuLlamaLayers(self.lib, self.linear_kernel)
                                   if self.linear_kernel is not None and layers_usable(self.lib) else None)
        # weights kept in GGUF blocks (pagedkv.core.model.quant_linear.HasQuantKernel)
        self.quant_kernel = CpuQuantKernel(self.lib) if quant_usable(self.lib) else None
        self.quant_layer_kernel = CpuQuantLlamaLayers(self.lib) if quant_layers_usable(self.lib) else None
        # for --dtype auto (pagedkv.core.dtype_choice.HasDtypeFeatures): by default the build's CPU features
        bf16_kernel = self.linear_kernel is not None and torch.bfloat16 in self.linear_kernel.dtypes
        self.dtype_features = dtype_features or cpu_dtype_features(getattr(self.lib, "isa", None), bf16_kernel)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """fp32 / bf16 rows into a cache of their own dtype by one kernel call (each token's heads contiguous, as
        the model's projections give them); anything else (8-bit caches, a cast) by the reference."""
        if (k_cache.dtype in _DTYPES and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
                and k_cache.device.type == "cpu" and key.device.type == "cpu" and slot_mapping.dtype == torch.int64
                and hasattr(self.lib, "pagedkv_cpu_write_kv") and _rows_contiguous(key) and _rows_contiguous(value)
                and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.is_contiguous()
                and key.shape[1:] == value.shape[1:] == k_cache.shape[2:]
                and key.shape[0] == value.shape[0] == slot_mapping.shape[0]):
            rc = self.lib.pagedkv_cpu_write_kv(
                _DTYPES[k_cache.dtype], key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
                key.shape[1] * key.shape[2], k_cache.shape[0] * k_cache.shape[1])
            if rc == 0:
                return
        super().write_kv(key, value, k_cache, v_cache, slot_mapping)

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
        """Causal paged attention of ``query`` ``[T, H, D]``; optional left window and logit soft-capping.

        ``window`` w: a query at position p sees keys at positions in (p - w, p].
        ``softcap`` c: scores become ``c * tanh(score / c)`` before the softmax. None = off.
        An int8 cache (``--kv-cache-dtype int8``) in a decode-only step goes to the int8 decode kernel
        (``decode_int8.h``: 1 byte per value read, widened in registers); a float16 or fp8 cache, an int8 one
        in a step with prefill chunks, or a cache of another dtype than the query (the kernel would round the
        query to the cache's) is read by the reference, dequantizing in its gather.
        """
        if k_cache.dtype == torch.int8 and k_cache.device.type == "cpu" and meta.num_tokens == meta.num_seqs:
            return self._decode_int8(query, k_cache, v_cache, meta, scale, window, softcap)
        if k_cache.device.type == "cpu" and (k_cache.dtype in REFERENCE_DTYPES or (
                k_cache.dtype in _DTYPES and query.dtype in _DTYPES and query.dtype != k_cache.dtype)):
            return super().attend(query, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
        if k_cache.dtype not in _DTYPES or k_cache.device.type != "cpu":
            raise ValueError(f"the cpu backend runs float32/bfloat16 caches on the CPU, got {k_cache.dtype} "
                             f"on {k_cache.device}")
        check_window(window)
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
        if self.routes.decode == TORCH:
            return super().attend(query, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
        prefill_by_torch = self.routes.prefill == TORCH and meta.max_query_len > 1
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the cpu backend needs contiguous K/V caches")
        num_tokens, num_heads, head_dim = query.shape
        out_dtype = query.dtype
        q = query if query.dtype == k_cache.dtype else query.to(k_cache.dtype)
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=k_cache.dtype)
        if num_tokens == 0:
            return out.to(out_dtype)
        tables, ctx, starts = _index_tensors(meta)
        rc = self.lib.pagedkv_cpu_attend(
            _DTYPES[k_cache.dtype], q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
            out.data_ptr(), tables.data_ptr(), tables.stride(0), ctx.data_ptr(), starts.data_ptr(), meta.num_seqs,
            num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], float(scale), int(window or 0),
            float(softcap or 0.0), QUERY_TILE, torch.get_num_threads(), 1 if prefill_by_torch else 3,
        )
        if rc != 0:
            raise ValueError(f"cpu attention rejected the shapes: {num_heads} query heads, {k_cache.shape[2]} KV "
                             f"heads, head_dim {head_dim}, block size {k_cache.shape[1]} (code {rc})")
        if prefill_by_torch:
            attend_prefills(out, q, k_cache, v_cache, meta, scale, window, softcap)
        return out if out_dtype == out.dtype else out.to(out_dtype)

    def _decode_int8(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
        check_window(window)
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
        num_tokens, num_heads, head_dim = query.shape
        q = query.float()
        if q.stride(2) != 1:
            q = q.contiguous()
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.float32)
        if num_tokens == 0:
            return out.to(query.dtype)
        tables, seq_lens = _decode_index_tensors(meta)
        rc = self.lib.pagedkv_cpu_decode_int8(
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), meta.num_seqs, num_heads, k_cache.shape[2],
            head_dim, k_cache.shape[1], float(scale), int(window or 0), float(softcap or 0.0), torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"cpu int8 decode rejected the shapes: {num_heads} query heads, {k_cache.shape[2]} KV "
                             f"heads, head_dim {head_dim} (code {rc})")
        return out if query.dtype == torch.float32 else out.to(query.dtype)


def _decode_index_tensors(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 contiguous CPU block tables and sequence lengths, once per step."""
    cached = meta.backend_cache.get("cpu.decode_index")
    if cached is None:
        cached = tuple(t.to(device="cpu", dtype=torch.int32).contiguous() for t in (meta.block_tables, meta.seq_lens))
        meta.backend_cache["cpu.decode_index"] = cached
    return cached


def _index_tensors(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32, contiguous CPU copies of the index tensors, made once per step and shared by the layers."""
    cached = meta.backend_cache.get("cpu.index")
    if cached is None:
        cached = tuple(
            t.to(device="cpu", dtype=torch.int32).contiguous()
            for t in (meta.block_tables, meta.context_lens, meta.query_start_loc)
        )
        meta.backend_cache["cpu.index"] = cached
    return cached


def _rows_contiguous(rows: torch.Tensor) -> bool:
    """``[T, H, D]`` whose every token's ``H x D`` elements are one contiguous stretch."""
    return rows.dim() == 3 and rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]
