"""The cpu backend's linear on GGUF blocks (``quant_linear.h``) against a float64 product of the de-quantized weight
(de-quantized by the ``gguf`` package, an independent reading of the formats), for every build this CPU runs: fresh
random inputs per case, NaN-poisoned outputs and guards after every buffer, row counts around the register tiles
(1, 5, 13, 61, ...) and weight-row counts that are not a multiple of the column block; then ``CpuQuantKernel`` and
the torch path of ``QuantLinear`` on the same blocks."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from conftest import cpu_kernel_build
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.quant_linear import CpuQuantKernel
from pagedkv.core.model.quant_formats import FORMATS, dequantize
from pagedkv.core.model.quant_linear import QuantLinear, quantized_linears

gguf = pytest.importorskip("gguf")

ROWS = [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 61]
OUT_FEATURES = [1, 17, 40, 192]  # around C (2-8) and the 16-row column block
IN_FEATURES = [32, 576]
GUARD = 64
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", params=build.checked_variants())
def kernel(request) -> CpuQuantKernel:
    return CpuQuantKernel(cpu_kernel_build(request.param))


def quantized(qtype: str, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Random weights quantized by the ``gguf`` package: ``[out, row_bytes]`` uint8 blocks."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features), dtype=np.float32) * rng.uniform(0.01, 2.0)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(blocks))


def gguf_dequantized(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype]).copy())


def reference(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x W^T`` and the bound of an fp32 sum of those terms (``K + 1`` roundings), doubled; the
    de-quantization itself (one fma per weight) adds at most one rounding per term."""
    out = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T
    return out, 2 * (x.shape[-1] + 2) * EPS32 * size + 1e-30


@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("in_features", IN_FEATURES)
@pytest.mark.parametrize("out_features", OUT_FEATURES)
def test_direct_call_matches_float64_of_the_dequantized_weight(kernel, qtype, in_features, out_features):
    gen = torch.Generator().manual_seed(in_features * 1000 + out_features)
    blocks = quantized(qtype, out_features, in_features, seed=in_features + out_features)
    w = gguf_dequantized(blocks, qtype)
    w_buf = torch.full((blocks.numel() + GUARD,), 0xFF, dtype=torch.uint8)  # guard bytes: NaN-ish fp16 scales
    w_buf[: blocks.numel()] = blocks.reshape(-1)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        x_buf = torch.full((rows * in_features + GUARD,), float("nan"))
        x_buf[: x.numel()] = x.reshape(-1)
        y_buf = torch.full((rows * out_features + GUARD,), float("nan"))
        threads = 1 + rows % 2
        rc = kernel.lib.pagedkv_cpu_quant_linear(FORMATS[qtype].code, ctypes.c_void_p(x_buf.data_ptr()), rows,
                                                 in_features, ctypes.c_void_p(w_buf.data_ptr()), out_features,
                                                 ctypes.c_void_p(y_buf.data_ptr()), threads)
        assert rc == 0
        got = y_buf[: rows * out_features].view(rows, out_features)
        want, bound = reference(x, w)
        assert torch.isfinite(got).all(), (qtype, rows)
        assert ((got.double() - want).abs() <= bound).all(), (qtype, rows, (got.double() - want).abs().max())
        assert y_buf[rows * out_features:].isnan().all(), "a write past the output"


def test_bad_sizes_and_formats_are_refused(kernel):
    x, y = torch.zeros(2, 64), torch.zeros(2, 4)
    blocks = quantized("Q8_0", 4, 64, seed=1)

    def call(fmt, k, n=4):
        return kernel.lib.pagedkv_cpu_quant_linear(fmt, x.data_ptr(), 2, k, blocks.data_ptr(), n, y.data_ptr(), 1)

    assert call(0, 63) == 1 and call(0, 0) == 1 and call(0, 64, n=0) == 1
    assert call(7, 64) == 1 and call(-1, 64) == 1
    assert call(0, 64) == 0


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_quant_linear_kernel_and_torch_paths_agree_with_the_gguf_package(kernel, qtype):
    """The torch de-quantization equals the gguf package's bit for bit; the kernel path (3-D, non-contiguous
    input) equals the torch path up to fp32 rounding."""
    blocks = quantized(qtype, 40, 96, seed=7)
    assert torch.equal(dequantize(blocks, qtype, 96), gguf_dequantized(blocks, qtype))
    layer = QuantLinear(blocks, qtype, 96, 40)
    x = torch.randn(1, 96, 13).transpose(1, 2)  # [1, 13, 96], not contiguous
    with torch.inference_mode():
        plain = layer(x)
        with quantized_linears(kernel):
            fast = layer(x)
    want, bound = reference(x[0], gguf_dequantized(blocks, qtype))
    assert fast.shape == plain.shape == (1, 13, 40)
    assert ((fast[0].double() - want).abs() <= bound).all()
    assert ((plain[0].double() - want).abs() <= bound).all()
