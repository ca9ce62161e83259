"""The cpu backend's fp32 linear layer (``linear.h``), offered to the model runner as its
:class:`~pagedkv.core.model.cpu_linear.LinearKernel`: weights packed once into the kernel's column panels."""

from __future__ import annotations

import torch


class CpuLinearKernel:
    """``y = x W^T + b`` by the compiled kernel, for fp32 CPU tensors; ``pack`` makes the weight's panels."""

    def __init__(self, lib) -> None:  # noqa: ANN001 - a ctypes library from build.load
        self.lib = lib
        self.panel = int(lib.pagedkv_cpu_linear_panel())
        self.name = f"cpu-{getattr(lib, 'isa', 'custom')}-panel{self.panel}"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``[out, in]`` -> ``[ceil(out / panel), in, panel]``, zero rows past ``out``."""
        out_features, in_features = weight.shape
        padded = -(-out_features // self.panel) * self.panel
        w = weight.detach()
        if padded != out_features:
            w = torch.cat([w, w.new_zeros(padded - out_features, in_features)])
        return w.reshape(padded // self.panel, self.panel, in_features).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        in_features = x.shape[-1]
        rows = x.numel() // in_features if in_features else 0
        flat = x.reshape(rows, in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
        if bias is not None:
            bias = bias.detach().contiguous()
        rc = self.lib.pagedkv_cpu_linear(
            flat.data_ptr(), rows, in_features, packed.data_ptr(), None if bias is None else bias.data_ptr(),
            out_features, out.data_ptr(), torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"the cpu linear kernel rejected {rows} x {in_features} -> {out_features} (code {rc})")
        return out


def usable(lib) -> bool:  # noqa: ANN001
    """Whether ``lib`` has the linear kernel (a library built from an older source, bound for A/B runs, may not)."""
    return hasattr(lib, "pagedkv_cpu_linear")
