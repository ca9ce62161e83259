"""``copy_blocks`` for copy-on-write: one launch copies every (src, dst) pair in every layer.

Grid: ``(pair, layer, chunk)``: the pair count, the only large one, is on axis
0 (up to 2**31 - 1 programs; axes 1 and 2 stop at 65,535). The layers' caches are separate tensors, so the
kernel gets a table of their base addresses and turns each into a typed
pointer. A block is contiguous inside (``block_size * Hkv * D`` elements) in
the standard layout; the program copies one chunk of the K block and the same
chunk of the V block. Pairs are copied in parallel, so a block must not be both
a destination and a source in the same call (copy-on-write never asks for that).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.core.kv.kv_dtype import byte_view


@triton.jit
def _copy_blocks_kernel(
    k_addrs_ptr,  # int64 [layers]: base address of each layer's K cache
    v_addrs_ptr,  # int64 [layers]
    pairs_ptr,  # int64 [N, 2]
    typed_ptr,  # any cache: only its element type is used
    block_stride,
    block_numel,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1)
    offs = tl.program_id(2).to(tl.int64) * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    mask = offs < block_numel
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64) * block_stride
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64) * block_stride
    elem = typed_ptr.dtype.element_ty
    k_base = tl.load(k_addrs_ptr + layer).to(tl.pointer_type(elem))
    v_base = tl.load(v_addrs_ptr + layer).to(tl.pointer_type(elem))
    tl.store(k_base + dst + offs, tl.load(k_base + src + offs, mask=mask), mask=mask)
    tl.store(v_base + dst + offs, tl.load(v_base + src + offs, mask=mask), mask=mask)


def _check_layout(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    first = kv_caches[0][0]
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        for cache in (k_cache, v_cache):
            if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                raise ValueError(f"layer {layer}: every cache must match layer 0's shape, dtype and device")
            if cache.stride() != first.stride() or not cache[0].is_contiguous():
                raise ValueError(f"layer {layer}: copy_blocks needs caches whose blocks are contiguous inside")


MAX_GRID_YZ = 65535


def copy_grid(num_pairs: int, num_layers: int, block_numel: int, chunk: int) -> tuple[int, int, int]:
    """Launch grid of the copy kernel, with the (unbounded) pair count on axis 0."""
    grid = (num_pairs, num_layers, triton.cdiv(block_numel, chunk))
    if grid[1] > MAX_GRID_YZ or grid[2] > MAX_GRID_YZ:
        raise ValueError(f"copy_blocks: grid {grid} exceeds CUDA's 65,535 limit on axes 1 and 2")
    return grid


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor, chunk: int = 1024) -> None:
    """For every layer, copy block ``pairs[i, 0]`` onto block ``pairs[i, 1]`` in both K and V caches."""
    if not kv_caches or pairs.numel() == 0:
        return
    _check_layout(kv_caches)
    first = byte_view(kv_caches[0][0])  # an fp8 cache is copied as its bytes (values and scales alike)
    device = first.device
    pairs = pairs.to(device=device, dtype=torch.int64).contiguous()
    if pairs.dim() != 2 or pairs.shape[1] != 2:
        raise ValueError(f"pairs must be [N, 2], got {tuple(pairs.shape)}")
    k_addrs = torch.tensor([k.data_ptr() for k, _ in kv_caches], dtype=torch.int64, device=device)
    v_addrs = torch.tensor([v.data_ptr() for _, v in kv_caches], dtype=torch.int64, device=device)
    block_numel = first[0].numel()
    chunk = min(chunk, triton.next_power_of_2(block_numel))
    grid = copy_grid(pairs.shape[0], len(kv_caches), block_numel, chunk)
    _copy_blocks_kernel[grid](k_addrs, v_addrs, pairs, first, first.stride(0), block_numel, CHUNK=chunk)
