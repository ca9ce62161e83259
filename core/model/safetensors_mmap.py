"""Tensors of a ``.safetensors`` file as views of one private memory map: no copy at load time.

The format is an 8-byte little-endian header length, a JSON header (``name -> dtype, shape,
data_offsets``, offsets relative to the end of the header) and the raw little-endian data. Reading it
through ``safetensors``' ``get_tensor`` copies every byte (seconds for a 0.5 GB checkpoint on a busy
machine); a view of a copy-on-write map costs nothing until a page is touched, and the page cache
serves it. Only the floating dtypes a model checkpoint holds are read here; anything else raises
``ValueError`` and the caller falls back.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``path``, each a view of the file's memory map (writable: the map is private)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > path.stat().st_size - 8:  # a corrupt file: never read (or allocate) past its end
            raise ValueError(f"{path}: its header length {length} runs past the end of the file")
        header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError(f"{path}: the header is not a JSON object")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES.get(info["dtype"])
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry") from exc
        if dtype is None:
            raise ValueError(f"{name}: dtype {info['dtype']} is not read here")
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = (end - begin) // itemsize
        if begin < 0 or count != (torch.Size(shape).numel()) or base + end > len(mapped):
            raise ValueError(f"{name}: offsets {begin}..{end} do not hold shape {shape}")
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin) if count else torch.empty(
            0, dtype=dtype)
        tensors[name] = flat.view(shape)
    return tensors
