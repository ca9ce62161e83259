"""The cpu backend's linear on GGUF-block weights (``quant_linear.h``), offered to the model runner as its
:class:`~pagedkv.core.model.quant_linear.QuantKernel` (``quantization gguf``): the blocks as ``QuantLinear`` holds
them (repacked at load, ``core/model/quant_packing.py``), de-quantized in registers."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from pagedkv.core.model.quant_formats import FORMATS, row_bytes
from pagedkv.core.model.quant_packing import unpack


class CpuQuantKernel:
    """``y = x W^T`` by the compiled kernel, for fp32 CPU ``x`` and ``W`` in Q8_0 / Q4_0 / Q4_1 blocks."""

    def __init__(self, lib: Any, int8: bool = False) -> None:  # a ctypes library from build.load
        """``int8``: the integer path (activations rounded to int8 per 32-block; ``quant_int8.h``), for tests and
        benchmarks: slower here than the float path, and outside issue 44's agreement goal (JOURNAL.md). It reads the
        file's layout: each weight is unpacked once and kept beside the packed one (a test path: twice the memory)."""
        self.lib = lib
        self.path = "float"
        self.entry = lib.pagedkv_cpu_quant_linear
        self._unpacked: dict[int, tuple[Any, torch.Tensor]] = {}  # id(packed) -> (weakref to it, file layout)
        if int8:
            self.path = lib.pagedkv_cpu_quant_int8_path().decode()
            if self.path == "none":
                raise ValueError(f"the {getattr(lib, 'isa', '?')} build has no integer path")
            self.entry = lib.pagedkv_cpu_quant_linear_int8

    def supports(self, qtype: str) -> bool:
        return qtype in FORMATS

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, qtype: str, out_features: int) -> torch.Tensor:
        """``x W^T`` for ``blocks`` in the packed layout (``quant_packing.pack``)."""
        in_features = x.shape[-1]
        rows = x.numel() // in_features if in_features else 0
        if tuple(blocks.shape) != (out_features, row_bytes(qtype, in_features)) or not blocks.is_contiguous():
            raise ValueError(f"{qtype} blocks {list(blocks.shape)} do not hold a contiguous {out_features} x "
                             f"{in_features} weight")
        if self.path != "float":
            blocks = self._file_layout(blocks, qtype, in_features)
        flat = x.reshape(rows, in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
        rc = self.entry(FORMATS[qtype].code, flat.data_ptr(), rows, in_features,
                                               blocks.data_ptr(), out_features, out.data_ptr(),
                                               torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"the cpu quantized linear rejected {rows} x {in_features} -> {out_features} "
                             f"{qtype} (code {rc})")
        return out


    def _file_layout(self, blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
        """``blocks`` unpacked, kept while ``blocks`` lives (the integer path reads the file's layout)."""
        key = id(blocks)
        held = self._unpacked.get(key)
        if held is None or held[0]() is not blocks:
            held = (weakref.ref(blocks), unpack(blocks, qtype, in_features))
            self._unpacked[key] = held
            weakref.finalize(blocks, self._unpacked.pop, key, None)
        return held[1]


def usable(lib: Any) -> bool:
    """Whether ``lib`` has the quantized linear (a library built from an older source may not)."""
    return hasattr(lib, "pagedkv_cpu_quant_linear")
