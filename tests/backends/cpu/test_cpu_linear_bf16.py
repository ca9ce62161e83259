"""The cpu backend's packed linear on bf16 weights (``linear.h``'s bf16 formats) against a float64 reference, for
every build this CPU runs: the AVX-512-BF16 build's ``vdpbf16ps`` path (activations rounded to bf16 pairs) and
every other build's widening of the weights in registers (fp32 activations). Fresh random inputs, NaN-poisoned
outputs, guards after every buffer, odd K, N not a multiple of the panel, 1-121 rows; the bf16 panel layout; and
``CpuLinearKernel.linear`` on bf16 inputs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import cpu_kernel_build
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.linear import CpuLinearKernel

ROWS = [0, 1, 2, 5, 6, 7, 12, 13, 59, 60, 61, 121]  # around the register tiles (6, 12) and the row chunk (60)
OUT_FEATURES = [1, 15, 17, 40, 200, 576]  # a panel's tails for panels of 8, 16 and 32, and per-thread ranges
IN_FEATURES = [1, 3, 48, 130, 577]  # odd K (the pad step), one partial block, two and a bit (blocks of 128 k)
GUARD = 64
EPS32 = torch.finfo(torch.float32).eps
DOT = "avx512-bf16 vdpbf16ps"


@pytest.fixture(scope="module", params=build.checked_variants())
def kernel(request) -> CpuLinearKernel:
    isa = request.param
    return CpuLinearKernel(cpu_kernel_build(isa))


def test_each_build_reports_its_bf16_path(kernel):
    # the AVX-512-BF16 build must take vdpbf16ps (else this machine never ran it), every other build widens
    expected = DOT if kernel.lib.isa == "avx512-bf16" else "widened in registers"
    assert kernel.bf16_path == expected
    assert torch.bfloat16 in kernel.dtypes


def guarded(values: torch.Tensor) -> torch.Tensor:
    """A flat buffer of ``values``' dtype holding them, then ``GUARD`` NaNs."""
    flat = torch.full((values.numel() + GUARD,), float("nan"), dtype=values.dtype)
    flat[: values.numel()].copy_(values.reshape(-1))
    return flat


def reference(kernel: CpuLinearKernel, x: torch.Tensor, w: torch.Tensor,
              bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x W^T + b`` of the bf16 weight, with x as the build reads it (rounded to bf16 on the dot path), and
    the bound of an fp32 sum of those terms (``K + 1`` roundings of at most ``eps`` each), doubled."""
    xs = x.bfloat16().double() if kernel.bf16_path == DOT else x.double()
    out, size = xs @ w.double().T, xs.abs() @ w.double().abs().T
    if bias is not None:
        out, size = out + bias.double(), size + bias.double().abs()
    return out, 2 * (x.shape[-1] + 1) * EPS32 * size + 1e-30


def call(kernel: CpuLinearKernel, x, rows, k, packed, bias, n, y, threads) -> int:
    ptr = ctypes.c_void_p
    return kernel.lib.pagedkv_cpu_linear_bf16(ptr(x), rows, k, ptr(packed), None if bias is None else ptr(bias), n,
                                              ptr(y), threads)


@pytest.mark.parametrize("in_features", IN_FEATURES)
@pytest.mark.parametrize("out_features", OUT_FEATURES)
def test_bf16_weights_match_float64(kernel, in_features, out_features):
    gen = torch.Generator().manual_seed(7 * in_features + out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    packed = kernel.pack(w).clone()
    pad = packed.shape[0] * kernel.panel - out_features
    if pad:  # the pad columns poisoned: multiplied, never stored (the pad k of an odd K must stay zero)
        packed[-1, :, kernel.panel - pad:, :] = float("nan")
    packed_buf = guarded(packed)
    for bias_on in (False, True):
        bias = torch.randn(out_features, generator=gen) if bias_on else None
        bias_buf = guarded(bias) if bias_on else None
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=gen)
            x_buf = guarded(x)
            y_buf = torch.full((rows * out_features + GUARD,), float("nan"))
            rc = call(kernel, x_buf.data_ptr(), rows, in_features, packed_buf.data_ptr(),
                      None if bias_buf is None else bias_buf.data_ptr(), out_features, y_buf.data_ptr(), 1 + rows % 3)
            assert rc == 0
            y = y_buf[: rows * out_features].view(rows, out_features)
            case = f"{kernel.lib.isa}: {rows} x {in_features} -> {out_features}, bias {bias_on}"
            assert torch.isfinite(y).all(), f"{case}: NaN in y (an unwritten output, or a pad or guard read)"
            assert torch.isnan(y_buf[rows * out_features:]).all(), f"{case}: wrote past the end of y"
            expected, tol = reference(kernel, x, w, bias)
            err = (y.double() - expected).abs()
            assert (err <= tol).all(), f"{case}: error {(err / tol).max().item():.3g} x the bound"


def test_bf16_pack_is_column_pairs_padded_with_zeros(kernel):
    for out_features, in_features in ((17, 5), (40, 6)):
        w = (torch.randn(out_features, in_features) + 10.0).bfloat16()  # no zero in the weight itself
        packed = kernel.pack(w)
        panels, deep = -(-out_features // kernel.panel), -(-in_features // 2)
        assert packed.shape == (panels, deep, kernel.panel, 2) and packed.dtype == torch.bfloat16
        for p in range(panels):
            for j in range(kernel.panel):
                column = p * kernel.panel + j
                for k in range(2 * deep):
                    real = column < out_features and k < in_features
                    expected = w[column, k] if real else torch.tensor(0, dtype=torch.bfloat16)
                    assert packed[p, k // 2, j, k % 2] == expected, (out_features, in_features, p, j, k)


@pytest.mark.parametrize("shape", [(2, 7), (1, 0), (3, 1)], ids=["2x7", "empty", "3x1"])
def test_linear_on_bf16_inputs_returns_bf16(kernel, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    k, n = 47, 33
    w, bias = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(*shape, 2 * k, generator=gen).bfloat16()[..., ::2]  # strided
    for b in (None, bias):
        got = kernel.linear(x, kernel.pack(w), b, n)
        assert got.shape == (*shape, n) and got.dtype == torch.bfloat16
        expected, tol = reference(kernel, x.float(), w, None if b is None else b.float())
        # the fp32 result rounded to bf16 once more: half a bf16 ulp of the value
        assert ((got.double() - expected).abs() <= tol + expected.abs() * 2.0**-8).all()


def test_bad_sizes_return_nonzero(kernel):
    w = kernel.pack(torch.randn(16, 8).bfloat16())
    x, y = torch.randn(4, 8), torch.full((64,), float("nan"))
    for rows, k, n in ((-1, 8, 16), (4, 0, 16), (4, 8, 0), (4, 2**31, 16), (4, 8, 2**31)):
        assert call(kernel, x.data_ptr(), rows, k, w.data_ptr(), None, n, y.data_ptr(), 1) != 0, (rows, k, n)
    assert torch.isnan(y).all(), "a rejected call wrote to y"
