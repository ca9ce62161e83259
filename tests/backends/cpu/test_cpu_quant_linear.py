"""The cpu backend's linear on GGUF blocks (``quant_linear.h``) against a float64 product of the de-quantized weight
(de-quantized by the ``gguf`` package, an independent reading of the formats), for every build this CPU runs: fresh
random inputs per case, NaN-poisoned outputs and guards after every buffer, row counts around the register tiles
(1, 5, 13, 61, ...) and weight-row counts that are not a multiple of the column block; then ``CpuQuantKernel`` and
the torch path of ``QuantLinear`` on the same blocks. Builds with AVX2 also have the integer path (``quant_int8.h``:
activations rounded to int8 per 32-block), run by every test too; its bound adds that rounding (``int8_bound``)."""

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
from pagedkv.core.model.quant_packing import pack

gguf = pytest.importorskip("gguf")

ROWS = [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 61]
OUT_FEATURES = [1, 13, 17, 40, 192]  # around C (2-8), the 8-row group and the 16-row column block
IN_FEATURES = [32, 160, 576]  # k not a multiple of 256 (nor of 64 blocks)
GUARD = 64
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", params=[(isa, int8) for isa in build.checked_variants() for int8 in (False, True)],
                ids=lambda p: f"{p[0]}-{'int8' if p[1] else 'float'}")
def kernel(request) -> CpuQuantKernel:
    isa, int8 = request.param
    lib = cpu_kernel_build(isa)
    if int8 and PATHS[isa] == "none":
        pytest.skip(f"the {isa} build has no integer path")
    return CpuQuantKernel(lib, int8=int8)


def test_each_build_has_its_integer_path(kernel):
    assert kernel.lib.pagedkv_cpu_quant_int8_path().decode() == PATHS[kernel.lib.isa]
    assert kernel.path in ("float", PATHS[kernel.lib.isa])


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_integer_path_is_the_product_of_the_int8_rounded_activations(kernel, qtype):
    """What the integer path computes: x' W^T for x' the activations rounded per block as int8_activations does,
    up to fp32 rounding (its difference from x W^T is many times that, so the float path fails this)."""
    if kernel.path == "float":
        pytest.skip("the float path")
    blocks = quantized(qtype, 40, 576, seed=11)
    w = gguf_dequantized(blocks, qtype)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    got = kernel.linear(x, pack(blocks, qtype, 576), qtype, 40).double()
    rounded = int8_activations(x)
    want = rounded @ w.double().T
    size = rounded.abs() @ (w.double().abs() + 2 * block_offsets(blocks, qtype, 576)).T
    assert ((got - want).abs() <= 2 * (576 + 2) * EPS32 * size + 1e-30).all()
    assert ((got - x.double() @ w.double().T).abs() > 2 * (576 + 2) * EPS32 * size).any()  # x' is not x


def quantized(qtype: str, out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """Random weights quantized by the ``gguf`` package: ``[out, row_bytes]`` uint8 blocks."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features), dtype=np.float32) * rng.uniform(0.01, 2.0)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(blocks))


def gguf_dequantized(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype]).copy())


# each build's integer path (pagedkv_cpu_quant_int8_path)
PATHS = {"avx512-bf16": "int8 avx512-vnni", "avx512": "int8 maddubs", "avx2-vnni": "int8 avx-vnni",
         "avx2": "int8 maddubs", "generic": "none", "avx512-shape": "none"}


def reference(x: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor | None = None, qtype: str = "",
              path: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x W^T`` and the bound of an fp32 sum of those terms (``K + 1`` roundings), doubled; the
    de-quantization itself (one fma per weight) adds at most one rounding per term. The integer path's bound
    (``path`` "int8 ...") is ``int8_bound``'s."""
    out = x.double() @ w.double().T
    if path != "float":
        return out, int8_bound(x, w, blocks, qtype)
    size = x.double().abs() @ w.double().abs().T
    return out, 2 * (x.shape[-1] + 2) * EPS32 * size + 1e-30


def block_offsets(blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """|m| of each weight's block ([out, k]): the offset in value = d q + m (Q8_0: 0, Q4_0: -8 d, Q4_1: its m)."""
    if qtype == "Q8_0":
        return torch.zeros(blocks.shape[0], k, dtype=torch.float64)
    per = blocks.view(blocks.shape[0], k // 32, -1)
    halves = per[..., :4].contiguous().view(torch.float16).double()  # d, then Q4_1's m (Q4_0: a nibble pair)
    m = 8 * halves[..., 0] if qtype == "Q4_0" else halves[..., 1]
    return m.abs().repeat_interleave(32, dim=1)


def int8_bound(x: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """The integer path computes x' W^T, x' = d q the activations rounded per 32-block (d = max|x| / 127):
    |x' - x| <= e = d / 2, times (1 + 1024 eps) for the fp32 roundings of d, 1 / d and x / d (each a relative eps
    of a quotient <= 127 + 1: under 2^9 eps steps). The integer dots are exact; the fp32 part (a scale product, a
    fused multiply-add per block and lane, the offset term m d sum(q) per block, the lane sum) is under K + 2
    roundings of terms bounded by (|d q| + |m|) |x'| <= (|w| + 2 |m|) (|x| + e)."""
    k = x.shape[-1]
    amax = x.double().abs().view(*x.shape[:-1], k // 32, 32).amax(-1, keepdim=True)
    e = (amax / 254 * (1 + 1024 * EPS32)).expand(*x.shape[:-1], k // 32, 32).reshape(x.shape)
    rounding = e @ w.double().abs().T
    size = (x.double().abs() + e) @ (w.double().abs() + 2 * block_offsets(blocks, qtype, k)).T
    return rounding + 2 * (k + 2) * EPS32 * size + 1e-30


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """The integer path's rounded activations d q, computed as the kernel does (fp32, round half to even)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    return (torch.round(blocks * inv) * step.double()).reshape(x.shape)


@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("in_features", IN_FEATURES)
@pytest.mark.parametrize("out_features", OUT_FEATURES)
def test_direct_call_matches_float64_of_the_dequantized_weight(kernel, qtype, in_features, out_features):
    gen = torch.Generator().manual_seed(in_features * 1000 + out_features)
    blocks = quantized(qtype, out_features, in_features, seed=in_features + out_features)
    w = gguf_dequantized(blocks, qtype)
    w_buf = torch.full((blocks.numel() + GUARD,), 0xFF, dtype=torch.uint8)  # guard bytes: NaN-ish fp16 scales
    # the float path reads the packed layout, the integer path the file's
    w_buf[: blocks.numel()] = (pack(blocks, qtype, in_features) if kernel.path == "float" else blocks).reshape(-1)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        x_buf = torch.full((rows * in_features + GUARD,), float("nan"))
        x_buf[: x.numel()] = x.reshape(-1)
        y_buf = torch.full((rows * out_features + GUARD,), float("nan"))
        threads = 1 + rows % 2
        rc = kernel.entry(FORMATS[qtype].code, ctypes.c_void_p(x_buf.data_ptr()), rows, in_features,
                          ctypes.c_void_p(w_buf.data_ptr()), out_features, ctypes.c_void_p(y_buf.data_ptr()), threads)
        assert rc == 0
        got = y_buf[: rows * out_features].view(rows, out_features)
        want, bound = reference(x, w, blocks, qtype, kernel.path)
        assert torch.isfinite(got).all(), (qtype, rows)
        assert ((got.double() - want).abs() <= bound).all(), (qtype, rows, (got.double() - want).abs().max())
        assert y_buf[rows * out_features:].isnan().all(), "a write past the output"


def test_bad_sizes_and_formats_are_refused(kernel):
    x, y = torch.zeros(2, 64), torch.zeros(2, 4)
    blocks = quantized("Q8_0", 4, 64, seed=1)

    def call(fmt, k, n=4):
        return kernel.entry(fmt, x.data_ptr(), 2, k, blocks.data_ptr(), n, y.data_ptr(), 1)

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
    w = gguf_dequantized(blocks, qtype)
    want, bound = reference(x[0], w, blocks, qtype, kernel.path)
    assert fast.shape == plain.shape == (1, 13, 40)
    assert ((fast[0].double() - want).abs() <= bound).all()
    want, bound = reference(x[0], w)
    assert ((plain[0].double() - want).abs() <= bound).all()
