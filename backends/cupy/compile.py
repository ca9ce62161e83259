"""The CUDA sources, every template instantiation the backend can ask for, and a device-free compile check.

The backend (``backend.py``) loads the same source text through ``cupy.RawModule``;
``compile_ptx`` compiles it with NVRTC directly (``cupy.cuda.nvrtc``), which
needs no GPU, so CI can check every instantiation for every target arch.
cupy is imported lazily, only inside the functions that need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).resolve().parent
# Order matters: common.cuh is inlined where the .cu files include it.
SOURCE_FILES = ("decode.cu", "prefill.cu", "cache_ops.cu", "write_kv_fp8.cu")

# dtype tag in the CUDA sources for each torch dtype the engine supports.
DTYPE_TAGS: dict[torch.dtype, str] = {
    torch.float32: "pagedkv::F32",
    torch.float16: "pagedkv::F16",
    torch.bfloat16: "pagedkv::BF16",
}
# Row-format tag (kv_row.cuh) of each quantized cache dtype the attention kernels read in the kernel; a cache of
# the model dtype uses the templates' default (KvSame) and keeps the shorter names.
KV_TAGS: dict[torch.dtype, str] = {
    torch.int8: "pagedkv::KvInt8",
    torch.float8_e4m3fn: "pagedkv::KvE4M3",
    torch.float8_e5m2: "pagedkv::KvE5M2",
}
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
# Block sizes with a specialised instantiation; 0 is the generic one that reads
# the block size at run time (any block size the config allows, 1..256).
BLOCK_SIZES = (16, 0)
# Query heads per KV head handled by one decode thread block (register tile).
HEAD_TILES = (1, 2, 4, 8)
# Word types copy_blocks may use, widest first, with their size in bytes.
COPY_WORDS = (("uint4", 16), ("unsigned int", 4), ("unsigned short", 2), ("unsigned char", 1))

# Options the backend passes to RawModule. CuPy adds -arch itself and also
# -ftz=true and --device-as-default-execution-space, mirrored in compile_ptx.
NVRTC_OPTIONS = ("-std=c++17",)
CUPY_IMPLICIT_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@lru_cache(maxsize=1)
def source() -> str:
    """All kernels as one translation unit, with the local ``#include "..."`` lines inlined once."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (SOURCE_DIR / name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return "\n".join(expand(name) for name in SOURCE_FILES)


def block_size_param(block_size: int) -> int:
    """The BLOCK_SIZE template argument used for a cache with this block size."""
    return block_size if block_size in BLOCK_SIZES else 0


def head_tile(group_size: int) -> int:
    """The decode kernel's G_TILE for ``group_size`` query heads per KV head."""
    for tile in HEAD_TILES:
        if group_size <= tile:
            return tile
    return HEAD_TILES[-1]


def copy_word(block_bytes: int, alignment: int) -> str:
    """Widest copy_blocks word that divides the block size in bytes and the caches' alignment."""
    for word, size in COPY_WORDS:
        if block_bytes % size == 0 and alignment % size == 0:
            return word
    raise AssertionError("unreachable: a byte always divides")


@dataclass(frozen=True)
class Names:
    """Name expressions of the kernels for one (dtype, head_dim, block_size) combination."""

    decode: dict[int, str]  # head tile -> name
    reduce: str
    prefill: str
    write_kv: str
    write_kv_int8: str  # into an int8 cache, from key/value of this dtype
    write_kv_fp8: dict[torch.dtype, str]  # into an fp8 cache of the key's dtype
    copy_blocks: dict[str, str]  # word type -> name

    def attention(self) -> list[str]:
        """The kernels that depend on head_dim and block_size."""
        return [*self.decode.values(), self.reduce, self.prefill]

    def cache_ops(self) -> list[str]:
        """The kernels that depend on the dtype at most (any head_dim and block size)."""
        return [self.write_kv, self.write_kv_int8, *self.write_kv_fp8.values(), *self.copy_blocks.values()]

    def all(self) -> list[str]:
        return [*self.attention(), *self.cache_ops()]


def names_for(
    dtype: torch.dtype,
    head_dim: int | None = None,
    block_size: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> Names:
    """Kernels the backend launches for queries of ``dtype`` over caches of this head dim and block size.

    ``cache_dtype``: a quantized cache's dtype (a key of ``KV_TAGS``); None for a cache of ``dtype`` itself.
    Without ``head_dim`` (and ``block_size``) only the cache-op names are meaningful.
    """
    tag = DTYPE_TAGS[dtype]
    kv = "" if cache_dtype is None or cache_dtype == dtype else f", {KV_TAGS[cache_dtype]}"
    hd = HEAD_DIMS[0] if head_dim is None else head_dim
    bs = block_size_param(16 if block_size is None else block_size)
    return Names(
        decode={g: f"pagedkv_decode<{tag}, {hd}, {bs}, {g}{kv}>" for g in HEAD_TILES},
        reduce=f"pagedkv_decode_reduce<{tag}, {hd}>",
        prefill=f"pagedkv_prefill<{tag}, {hd}, {bs}{kv}>",
        write_kv=f"pagedkv_write_kv<{tag}>",
        write_kv_int8=f"pagedkv_write_kv_int8<{tag}>",
        write_kv_fp8={
            torch.float8_e4m3fn: f"pagedkv_write_kv_fp8<{tag}, true>",
            torch.float8_e5m2: f"pagedkv_write_kv_fp8<{tag}, false>",
        },
        copy_blocks={word: f"pagedkv_copy_blocks<{word}>" for word, _ in COPY_WORDS},
    )


def all_instantiations() -> list[str]:
    """Every name expression the backend can ask for, without duplicates, in a stable order."""
    names: dict[str, None] = {}
    for dtype in DTYPE_TAGS:
        for head_dim in HEAD_DIMS:
            for block_size in BLOCK_SIZES:
                for cache_dtype in (None, *KV_TAGS):
                    for name in names_for(dtype, head_dim, block_size, cache_dtype).all():
                        names[name] = None
    return list(names)


class CompileError(RuntimeError):
    """NVRTC rejected the sources; ``log`` is the compiler's log."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(f"{message}\n{log}")
        self.log = log


def compile_ptx(arch: int, name_expressions: list[str] | None = None) -> tuple[str, dict[str, str]]:
    """Compile the sources to PTX for ``compute_<arch>`` with NVRTC, without a GPU.

    Returns the PTX and the lowered (mangled) name of every name expression
    (all instantiations by default). Raises :class:`CompileError` with the
    compiler log when compilation fails or a name expression is unresolved.
    """
    from cupy.cuda import nvrtc

    names = all_instantiations() if name_expressions is None else list(name_expressions)
    options = [*NVRTC_OPTIONS, *CUPY_IMPLICIT_OPTIONS, f"--gpu-architecture=compute_{arch}"]
    prog = nvrtc.createProgram(source(), "pagedkv_kernels.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as exc:
            raise CompileError(f"NVRTC failed for compute_{arch}: {exc}", nvrtc.getProgramLog(prog)) from None
        lowered = {}
        for name in names:
            try:
                lowered[name] = nvrtc.getLoweredName(prog, name)
            except nvrtc.NVRTCError as exc:
                raise CompileError(f"no kernel for {name} ({exc})", nvrtc.getProgramLog(prog)) from None
        ptx = nvrtc.getPTX(prog)
        return (ptx.decode() if isinstance(ptx, bytes) else ptx), lowered
    finally:
        nvrtc.destroyProgram(prog)
