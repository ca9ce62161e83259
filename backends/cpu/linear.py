"""The cpu backend's linear layer (``linear.h``), offered to the model runner as its
:class:`~pagedkv.core.model.cpu_linear.LinearKernel`: fp32 or bf16 weights packed once into the kernel's column
panels, fp32 sums (bf16 inputs and outputs are converted around the call)."""

from __future__ import annotations

import torch


class CpuLinearKernel:
    """``y = x W^T + b`` by the compiled kernel, for CPU tensors of ``dtypes`` (the weight's and the input's);
    ``pack`` makes the weight's panels."""

    def __init__(self, lib) -> None:  # noqa: ANN001 - a ctypes library from build.load
        self.lib = lib
        self.panel = int(lib.pagedkv_cpu_linear_panel())
        self.name = f"cpu-{getattr(lib, 'isa', 'custom')}-panel{self.panel}"
        bf16 = hasattr(lib, "pagedkv_cpu_linear_bf16")  # (a library built from an older source may lack it)
        self.dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
        # how this build multiplies bf16 weights (vdpbf16ps, or widened to fp32 in registers): for the logs
        self.bf16_path = lib.pagedkv_cpu_linear_bf16_path().decode() if bf16 else None

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """fp32 ``[out, in]`` -> ``[ceil(out / panel), in, panel]``, zero rows past ``out``; bf16 -> ``[ceil(out /
        panel), ceil(in / 2), panel, 2]`` (each column's two consecutive inputs side by side), zeros in the pads."""
        out_features, in_features = weight.shape
        padded = -(-out_features // self.panel) * self.panel
        w = weight.detach()
        if weight.dtype == torch.bfloat16:
            deep = in_features + in_features % 2
            w = torch.nn.functional.pad(w, (0, deep - in_features, 0, padded - out_features))
            return w.reshape(padded // self.panel, self.panel, deep // 2, 2).transpose(1, 2).contiguous()
        if padded != out_features:
            w = torch.cat([w, w.new_zeros(padded - out_features, in_features)])
        return w.reshape(padded // self.panel, self.panel, in_features).transpose(1, 2).contiguous()

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
               out_features: int) -> torch.Tensor:
        in_features = x.shape[-1]
        rows = x.numel() // in_features if in_features else 0
        flat = x.reshape(rows, in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()  # (the kernel reads fp32 activations)
        out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)
        if bias is not None:
            bias = bias.detach().to(torch.float32).contiguous()
        call = self.lib.pagedkv_cpu_linear_bf16 if packed.dtype == torch.bfloat16 else self.lib.pagedkv_cpu_linear
        rc = call(
            flat.data_ptr(), rows, in_features, packed.data_ptr(), None if bias is None else bias.data_ptr(),
            out_features, out.data_ptr(), torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"the cpu linear kernel rejected {rows} x {in_features} -> {out_features} (code {rc})")
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def usable(lib) -> bool:  # noqa: ANN001
    """Whether ``lib`` has the linear kernel (a library built from an older source, bound for A/B runs, may not)."""
    return hasattr(lib, "pagedkv_cpu_linear")
