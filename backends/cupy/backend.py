"""CuPy backend: the CUDA C kernels in this folder, compiled by NVRTC through ``cupy.RawModule``.

Torch owns every buffer (the KV caches, outputs, fp32 partials from torch's
caching allocator); the kernels see them zero-copy through DLPack and run on
torch's current stream, so they order with the model's own work without any
host synchronisation. bf16 tensors are viewed as int16 (CuPy has no bf16 dtype)
and converted inside the kernels.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from pagedkv.backends.base import check_window
from pagedkv.backends.cupy import compile as kc
from pagedkv.backends.torch_ref import attention as reference
from pagedkv.backends.torch_ref.attention import swap_blocks as reference_swap_blocks
from pagedkv.core.kv.attention_metadata import AttentionMetadata
from pagedkv.core.kv.kv_dtype import byte_view, is_quantized, row_width

NEEDS_CUDA = "the cupy backend needs a CUDA device; use --backend torch"
_THREADS = 128
_COPY_THREADS = 256
_DEFAULT_PARTITION = 512
_MIN_PARTITION = 128
_MAX_GRID_YZ = 65535
# Dynamic shared memory a kernel may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
SHARED_LIMIT = 48 * 1024
# Set to 1 to synchronise after every launch, so an asynchronous fault is reported at the kernel that caused it.
SYNC_ENV = "PAGEDKV_CUPY_SYNC"


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


@dataclass(frozen=True)
class _DecodeShape:
    """Mirror of DecodeShape in decode.cu (only what the launch needs)."""

    tpr: int
    elems: int
    groups: int

    @classmethod
    def of(cls, elem_size: int, head_dim: int) -> _DecodeShape:
        vec = 16 // elem_size
        row_vecs = head_dim // vec
        tpr = min(32, _next_pow2(row_vecs))
        vpt = -(-row_vecs // tpr)
        return cls(tpr=tpr, elems=vpt * vec, groups=_THREADS // tpr)

    def shared_bytes(self, head_tile: int, partition_size: int) -> int:
        floats = head_tile * partition_size + 2 * head_tile + self.groups // 2 * head_tile * self.elems * self.tpr
        return 4 * floats

    def max_partition(self, head_tile: int, limit: int = SHARED_LIMIT) -> int:
        """The longest partition whose scores still fit ``limit`` bytes of shared memory."""
        return (limit - self.shared_bytes(head_tile, 0)) // (4 * head_tile)


def decode_partition(requested: int, shape: _DecodeShape, head_tile: int, limit: int = SHARED_LIMIT) -> int:
    """The decode partition length actually launched: ``requested``, cut down so shared memory stays within
    ``limit`` (48 KiB needs no opt-in on any GPU; a partition near 1,000 tokens with 8 heads per tile would not)."""
    return max(1, min(requested, shape.max_partition(head_tile, limit)))


@dataclass
class _Call:
    """One attend() call's arguments, as the kernels take them."""

    meta: AttentionMetadata
    views: dict[str, Any]
    q: Any
    out: Any
    k: Any
    v: Any
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    elem_size: int
    scale: np.float32
    window: np.int32  # 0: no sliding window
    softcap: np.float32  # 0: no softcapping


class _Module:
    """Some of the kernels, compiled by NVRTC through CuPy (CuPy caches the binary on disk)."""

    def __init__(self, cupy: Any, names: list[str]) -> None:
        module = cupy.RawModule(code=kc.source(), options=kc.NVRTC_OPTIONS, name_expressions=names)
        try:
            module.compile()
        except Exception as exc:  # CompileException carries the NVRTC log in its message
            raise RuntimeError(f"cupy backend: NVRTC could not compile {names[0]} and co.: {exc}") from exc
        self.functions = {name: module.get_function(name) for name in names}


class CupyBackend:
    """Paged attention on hand-written CUDA C kernels, launched through CuPy."""

    name = "cupy"

    def __init__(self, config: Any) -> None:
        device = torch.device(getattr(config, "device", "cuda"))
        if device.type != "cuda":
            raise RuntimeError(f"{NEEDS_CUDA} (the engine's device is {str(device)!r})")
        if not torch.cuda.is_available():
            raise RuntimeError(f"{NEEDS_CUDA} (torch sees no CUDA device)")
        try:
            import cupy
        except ImportError as exc:
            raise RuntimeError(f"{NEEDS_CUDA} (cupy is not installed: pip install 'pagedkv[cupy]'; {exc})") from None
        try:
            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no device")
        except Exception as exc:  # noqa: BLE001 - CUDARuntimeError and friends: report them all the same way
            raise RuntimeError(f"{NEEDS_CUDA} (cupy cannot use the CUDA driver: {exc})") from None
        self._cupy = cupy
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.dtype = getattr(config, "dtype", torch.float16)
        if self.dtype not in kc.DTYPE_TAGS:
            raise ValueError(f"cupy backend: dtype {self.dtype} is not supported; use float32, float16 or bfloat16")
        self.block_size = int(getattr(config, "block_size", 16))
        # Decode partition length in tokens; None picks one per launch (shorter when the grid would be small).
        self.partition_size: int | None = None
        self._sync = os.environ.get(SYNC_ENV, "") not in ("", "0")
        self._modules: dict[tuple, _Module] = {}
        self._streams: dict[int, Any] = {}
        # Keyed by tensor identity (a plain WeakKeyDictionary would compare tensors with ==).
        self._cache_views: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._meta_views: tuple[AttentionMetadata, dict[str, Any]] | None = None
        self._ptr_tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # Compile (or load from CuPy's cache) the cache kernels now, so a broken toolchain fails here, not mid-run.
        self._cache_ops(self.dtype)

    # ------------------------------------------------------------------ plumbing

    def _module(self, key: tuple, names: list[str]) -> _Module:
        module = self._modules.get(key)
        if module is None:
            with self._cupy.cuda.Device(self.device.index):
                module = self._modules[key] = _Module(self._cupy, names)
        return module

    def _attention(
        self, dtype: torch.dtype, head_dim: int, block_size: int, cache_dtype: torch.dtype
    ) -> tuple[kc.Names, _Module]:
        """Decode, reduce and prefill kernels for queries of this dtype over caches of ``cache_dtype``, this
        head_dim and block size (compiled on first use)."""
        if head_dim not in kc.HEAD_DIMS:
            raise ValueError(
                f"cupy backend: head_dim {head_dim} has no compiled kernel (supported: {kc.HEAD_DIMS}); "
                "use --backend torch"
            )
        names = kc.names_for(dtype, head_dim, block_size, cache_dtype)
        key = ("attention", dtype, cache_dtype, head_dim, kc.block_size_param(block_size))
        return names, self._module(key, names.attention())

    def _cache_ops(self, dtype: torch.dtype) -> tuple[kc.Names, _Module]:
        """write_kv and copy_blocks kernels for this dtype (any head_dim and block size)."""
        names = kc.names_for(dtype)
        return names, self._module(("cache_ops", dtype), names.cache_ops())

    def _stream(self) -> Any:
        """torch's current stream on our device, as a CuPy stream (cached per stream)."""
        ts = torch.cuda.current_stream(self.device)
        stream = self._streams.get(ts.cuda_stream)
        if stream is None:
            cs = self._cupy.cuda.Stream
            if hasattr(cs, "from_external") and hasattr(ts, "__cuda_stream__"):
                stream = cs.from_external(ts)
            else:  # CuPy 13, or a torch without the stream protocol
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stream = self._cupy.cuda.ExternalStream(ts.cuda_stream, self.device.index)
            self._streams[ts.cuda_stream] = stream
        return stream

    def _view(self, tensor: torch.Tensor) -> Any:
        """Zero-copy CuPy view of a CUDA tensor through DLPack (bf16 as int16 bits, fp8 as int8 bytes)."""
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.int16)
        tensor = byte_view(tensor)
        return self._cupy.from_dlpack(tensor)

    def _cache_view(self, cache: torch.Tensor) -> Any:
        """Views of long-lived KV cache tensors are made once and dropped with the tensor."""
        view = self._cache_views.get(cache)
        if view is None:
            view = self._cache_views[cache] = self._view(cache)
        return view

    def _launch(
        self, kernel: Any, what: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0
    ) -> None:
        """Launch on the current (torch) stream and check for errors."""
        if any(g < 1 for g in grid):
            return
        if grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
            raise ValueError(f"cupy backend: grid {grid} of {what} is too large")
        try:
            kernel(grid, block, args, shared_mem=shared_mem)
            if self._sync:
                self._cupy.cuda.get_current_stream().synchronize()
        except Exception as exc:  # CUDADriverError / CUDARuntimeError
            raise RuntimeError(f"cupy backend: {what} failed (grid {grid}, block {block}): {exc}") from exc

    def _check_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError(
                f"cupy backend: caches must be [num_blocks, block_size, kv_heads, head_dim] of one shape and dtype, "
                f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}"
            )
        for cache in (k_cache, v_cache):
            if cache.device != self.device:
                raise ValueError(f"cupy backend: cache on {cache.device}, expected {self.device}")
            if not cache.is_contiguous() or cache.data_ptr() % 16:
                raise ValueError("cupy backend: KV caches must be contiguous and 16-byte aligned")
        if k_cache.dtype not in kc.DTYPE_TAGS and not is_quantized(k_cache.dtype):
            raise ValueError(f"cupy backend: cache dtype {k_cache.dtype} is not supported")

    def _meta(self, meta: AttentionMetadata) -> dict[str, Any]:
        """Device views of the step's index tensors, made once per step (metadata is shared by all layers)."""
        if self._meta_views is not None and self._meta_views[0] is meta:
            return self._meta_views[1]

        def int32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=torch.int32).contiguous()

        tensors = {
            "block_tables": int32(meta.block_tables),
            "seq_lens": int32(meta.seq_lens),
            "context_lens": int32(meta.context_lens),
            "query_start_loc": int32(meta.query_start_loc),
        }
        views = {name: self._view(t) for name, t in tensors.items()}
        views["_tensors"] = tensors  # keep the (possibly converted) tensors alive with their views
        self._meta_views = (meta, views)
        return views

    def _partition_size(self, work_items: int, max_len: int) -> int:
        if self.partition_size is not None:
            return self.partition_size
        size = _DEFAULT_PARTITION
        # Short grids leave SMs idle: split long histories finer until there are ~2 blocks per SM.
        while size > _MIN_PARTITION and work_items * -(-max_len // size) < 2 * self._num_sms:
            size //= 2
        return size

    # ------------------------------------------------------------------ interface

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Scatter ``key``/``value`` rows ``[T, Hkv, D]`` into their slots; slot -1 is skipped.

        An 8-bit cache is quantized by ``pagedkv_write_kv_int8`` / ``pagedkv_write_kv_fp8``, bit for bit as
        the reference."""
        self._check_cache(k_cache, v_cache)
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        heads, head_dim = k_cache.shape[2], key.shape[-1]
        if key.shape != (num_tokens, heads, head_dim) or value.shape != key.shape or (
                k_cache.shape[3] != row_width(head_dim, k_cache.dtype)):
            raise ValueError(
                f"cupy backend: key/value {tuple(key.shape)} do not match the cache rows {(heads, head_dim)}"
            )
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"cupy backend: {slot_mapping.shape[0]} slots for {num_tokens} tokens")
        quantized = is_quantized(k_cache.dtype)
        if quantized:  # quantized from the model's own dtype
            source = key.dtype if key.dtype in kc.DTYPE_TAGS else torch.float32
            key, value = key.to(source), value.to(source)
        else:
            key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
        if key.stride(-1) != 1:
            key = key.contiguous()
        if value.stride(-1) != 1:
            value = value.contiguous()
        slots = slot_mapping.to(device=self.device, dtype=torch.int64).contiguous()
        names, module = self._cache_ops(key.dtype)
        if not quantized:
            name = names.write_kv
        elif k_cache.dtype == torch.int8:
            name = names.write_kv_int8
        else:
            name = names.write_kv_fp8[k_cache.dtype]
        with self._cupy.cuda.Device(self.device.index), self._stream():
            args = (
                self._view(key),
                self._view(value),
                self._cache_view(k_cache),
                self._cache_view(v_cache),
                self._view(slots),
                np.int32(heads),
                np.int32(head_dim),
                np.int64(key.stride(0)),
                np.int64(key.stride(1)),
                np.int64(value.stride(0)),
                np.int64(value.stride(1)),
            )
            self._launch(module.functions[name], name, (num_tokens, 1, 1), (_THREADS, 1, 1), args)

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
        """Causal paged attention of packed ``query`` ``[T, H, D]``; returns ``[T, H, D]``.

        Sequences with one query row this step go to the decode kernel, the
        others (prefill chunks, with or without cached context) to the prefill
        kernel; the two write disjoint rows of the output. ``window``/``softcap``:
        see ``AttentionBackend.attend`` (passed to the kernels as 0 when unset). An 8-bit cache (int8, fp8) is read
        by the same kernels, dequantized in registers (one of a head_dim without a kernel by the torch
        reference's dequantizing gather).
        """
        check_window(window)
        self._check_cache(k_cache, v_cache)
        quantized = is_quantized(k_cache.dtype)
        if quantized and query.shape[-1] not in kc.HEAD_DIMS:
            # a head_dim without a kernel: the reference dequantizes in its gather, on the GPU
            return reference.paged_attention(query, k_cache, v_cache, meta, scale, window, softcap)
        _, block_size, num_kv_heads, width = k_cache.shape
        head_dim = query.shape[-1]
        if query.dim() != 3 or row_width(head_dim, k_cache.dtype) != width or query.shape[1] % num_kv_heads:
            raise ValueError(
                f"cupy backend: query {tuple(query.shape)} does not fit a cache with "
                f"{num_kv_heads} KV heads of {width}-element rows"
            )
        if quantized and query.dtype not in kc.DTYPE_TAGS:
            raise ValueError(f"cupy backend: query dtype {query.dtype} is not supported")
        if not quantized and query.dtype != k_cache.dtype:
            raise ValueError(f"cupy backend: query is {query.dtype} but the cache is {k_cache.dtype}")
        if meta.block_size != block_size:
            raise ValueError(f"cupy backend: metadata block_size {meta.block_size} != cache block size {block_size}")
        q = query.contiguous()
        if q.data_ptr() % 16:
            q = q.clone()
        out = torch.empty_like(q)
        if q.shape[0] == 0 or meta.num_seqs == 0:
            return out
        names, module = self._attention(q.dtype, head_dim, block_size, k_cache.dtype)
        with self._cupy.cuda.Device(self.device.index), self._stream():
            call = _Call(
                meta=meta,
                views=self._meta(meta),
                q=self._view(q),
                out=self._view(out),
                k=self._cache_view(k_cache),
                v=self._cache_view(v_cache),
                num_heads=q.shape[1],
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                block_size=block_size,
                elem_size=q.element_size(),
                scale=np.float32(scale),
                window=np.int32(window or 0),
                softcap=np.float32(softcap or 0.0),
            )
            if not meta.query_lens_cpu or 1 in meta.query_lens_cpu:
                self._decode(names, module, call)
            if meta.max_query_len > 1:
                self._prefill(names, module, call)
        return out

    def _decode(self, names: kc.Names, module: _Module, c: _Call) -> None:
        """Decode kernel for the sequences with one query row, plus the partition reduce for long ones."""
        meta = c.meta
        if meta.query_lens_cpu and meta.seq_lens_cpu:
            max_len = max(s for s, q in zip(meta.seq_lens_cpu, meta.query_lens_cpu) if q == 1)
        else:
            max_len = meta.max_seq_len
        if max_len < 1:
            return
        if c.window > 0:
            max_len = min(max_len, int(c.window))  # partitions cover only the window
        num_seqs = meta.num_seqs
        group_size = c.num_heads // c.num_kv_heads
        tile = kc.head_tile(group_size)
        head_tiles = -(-group_size // tile)
        shape = _DecodeShape.of(c.elem_size, c.head_dim)
        partition = decode_partition(self._partition_size(num_seqs * c.num_kv_heads * head_tiles, max_len), shape, tile)
        max_parts = -(-max_len // partition)
        if max_parts > 1:
            part_acc = torch.empty(
                (num_seqs, c.num_heads, max_parts, c.head_dim), dtype=torch.float32, device=self.device
            )
            part_max = torch.empty((num_seqs, c.num_heads, max_parts), dtype=torch.float32, device=self.device)
            part_sum = torch.empty_like(part_max)
            acc, pmax, psum = self._view(part_acc), self._view(part_max), self._view(part_sum)
        else:  # never written: the kernel writes partials only for sequences with several partitions
            acc = pmax = psum = c.out
        m = c.views
        args = (
            c.out,
            acc,
            pmax,
            psum,
            c.q,
            c.k,
            c.v,
            m["block_tables"],
            m["seq_lens"],
            m["query_start_loc"],
            np.int32(meta.block_tables.shape[1]),
            np.int32(c.num_heads),
            np.int32(c.num_kv_heads),
            np.int32(partition),
            np.int32(max_parts),
            np.int32(c.block_size),
            c.scale,
            c.window,
            c.softcap,
        )
        shared = shape.shared_bytes(tile, partition)
        grid = (num_seqs, c.num_kv_heads * head_tiles, max_parts)
        name = names.decode[tile]
        self._launch(module.functions[name], name, grid, (_THREADS, 1, 1), args, shared_mem=shared)
        if max_parts > 1:
            args = (
                c.out,
                acc,
                pmax,
                psum,
                m["seq_lens"],
                m["query_start_loc"],
                np.int32(c.num_heads),
                np.int32(partition),
                np.int32(max_parts),
                c.window,
            )
            self._launch(
                module.functions[names.reduce], names.reduce, (num_seqs, c.num_heads, 1), (_THREADS, 1, 1), args
            )

    def _prefill(self, names: kc.Names, module: _Module, c: _Call) -> None:
        """Prefill kernel for the sequences with two or more query rows."""
        m = c.views
        group_size = c.num_heads // c.num_kv_heads
        items_per_tile = 32 if c.head_dim <= 128 else 16  # PrefillShape::QM in prefill.cu
        grid = (c.meta.num_seqs, c.num_kv_heads, -(-c.meta.max_query_len * group_size // items_per_tile))
        args = (
            c.out,
            c.q,
            c.k,
            c.v,
            m["block_tables"],
            m["seq_lens"],
            m["context_lens"],
            m["query_start_loc"],
            np.int32(c.meta.block_tables.shape[1]),
            np.int32(c.num_heads),
            np.int32(c.num_kv_heads),
            np.int32(c.block_size),
            np.int32(2),  # min_query_len: single-row sequences belong to the decode kernel
            c.scale,
            c.window,
            c.softcap,
        )
        self._launch(module.functions[names.prefill], names.prefill, grid, (_THREADS, 1, 1), args)

    def copy_blocks(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
        """For every layer, copy block ``pairs[i, 0]`` onto block ``pairs[i, 1]`` (int64 ``[N, 2]``).

        Pairs are copied concurrently: no block may be both a source and a destination in one call.
        """
        if pairs.numel() == 0 or not kv_caches:
            return
        pairs = pairs.to(device=self.device, dtype=torch.int64).reshape(-1, 2).contiguous()
        by_shape: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        for k_cache, v_cache in kv_caches:
            self._check_cache(k_cache, v_cache)
            block_bytes = k_cache[0].numel() * k_cache.element_size()
            by_shape.setdefault((block_bytes, k_cache.dtype), []).extend((k_cache, v_cache))
        names, module = self._cache_ops(self.dtype)  # the copies move words: any cache dtype
        with self._cupy.cuda.Device(self.device.index), self._stream():
            pairs_v = self._view(pairs)
            for (block_bytes, _), caches in by_shape.items():
                ptrs = tuple(c.data_ptr() for c in caches)
                alignment = math.gcd(*ptrs, 256)
                word = kc.copy_word(block_bytes, alignment)
                word_size = dict(kc.COPY_WORDS)[word]
                table = self._ptr_tables.get(ptrs)
                if table is None:
                    if len(self._ptr_tables) > 64:
                        self._ptr_tables.clear()
                    table = torch.tensor(ptrs, dtype=torch.int64).to(self.device)
                    self._ptr_tables[ptrs] = table
                args = (self._view(table), pairs_v, np.int64(block_bytes // word_size))
                self._launch(
                    module.functions[names.copy_blocks[word]],
                    names.copy_blocks[word],
                    (pairs.shape[0], len(ptrs), 1),
                    (_COPY_THREADS, 1, 1),
                    args,
                )

    def swap_blocks(
        self,
        src: list[tuple[torch.Tensor, torch.Tensor]],
        dst: list[tuple[torch.Tensor, torch.Tensor]],
        pairs: torch.Tensor,
    ) -> None:
        """Copy blocks between two caches (e.g. device and CPU): ``src[pairs[i,0]] -> dst[pairs[i,1]]``.

        A plain memory transfer, done by the torch reference (gather, copy across devices, scatter) on the
        current stream.
        """
        reference_swap_blocks(src, dst, pairs.to(torch.int64).reshape(-1, 2))
