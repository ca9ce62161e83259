"""The cpu backend's packed fp32 linear (``linear.h``) against a float64 reference, for every build this CPU
runs: the C function called directly with NaN-poisoned outputs, pads and guards, over row counts around the
register tile and the row chunk and output widths around a panel; the packed layout; bad sizes; and
``CpuLinearKernel.linear`` on non-contiguous and 3-D inputs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from conftest import cpu_kernel_build
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.linear import CpuLinearKernel

ROWS = [0, 1, 2, 5, 6, 7, 12, 13, 59, 60, 61, 64, 65, 121, 130, 239, 241]  # around kMr (6, 12) and kRowChunk (60)
# a panel's tails for panels of 8, 16 and 32; 200 and 576 (SmolLM2's o_proj) split into per-thread panel ranges
# that end in groups of 1, 2 and 3 panels
OUT_FEATURES = [1, 15, 16, 17, 40, 200, 576]
IN_FEATURES = [1, 3, 48, 64, 130, 577]  # one k block of 64 is partial, whole, two and a bit, nine and one
GUARD = 64  # NaN floats after each buffer: a read past its end poisons a result, a write past it shows
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module", params=build.checked_variants())
def kernel(request) -> CpuLinearKernel:
    isa = request.param
    lib = cpu_kernel_build(isa)
    kernel = CpuLinearKernel(lib)
    if isa in build.LANES:
        assert kernel.panel == 2 * build.LANES[isa]
    return kernel


def guarded(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat fp32 buffer holding ``values`` then ``GUARD`` NaNs, and the view of ``values`` in it."""
    flat = torch.full((values.numel() + GUARD,), float("nan"))
    view = flat[: values.numel()].view(values.shape)
    view.copy_(values)
    return flat, view


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``x W^T + b`` and the error bound of an fp32 sum of those terms (``K + 1`` roundings of at most
    ``eps`` each, relative to the sum of the terms' magnitudes), doubled."""
    out = x.double() @ w.double().T
    size = x.double().abs() @ w.double().abs().T
    if bias is not None:
        out, size = out + bias.double(), size + bias.double().abs()
    return out, 2 * (x.shape[-1] + 1) * EPS32 * size + 1e-30


def call(kernel: CpuLinearKernel, x, rows, k, packed, bias, n, y, threads) -> int:
    ptr = ctypes.c_void_p
    return kernel.lib.pagedkv_cpu_linear(ptr(x), rows, k, ptr(packed), None if bias is None else ptr(bias), n,
                                         ptr(y), threads)


@pytest.mark.parametrize("in_features", IN_FEATURES)
@pytest.mark.parametrize("out_features", OUT_FEATURES)
def test_direct_call_matches_float64(kernel, in_features, out_features):
    gen = torch.Generator().manual_seed(in_features * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=gen)
    packed = kernel.pack(w)
    pad = packed.shape[0] * kernel.panel - out_features
    # the pad columns poisoned too: the kernel multiplies them, and must never let them into y
    poisoned = packed.clone()
    if pad:
        poisoned[-1, :, kernel.panel - pad:] = float("nan")
    packed_buf, _ = guarded(poisoned)
    for bias_on in (False, True):
        bias = torch.randn(out_features, generator=gen) if bias_on else None
        bias_buf = guarded(bias)[0] if bias_on else None
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=gen)
            x_buf, _ = guarded(x)
            y_buf = torch.full((rows * out_features + GUARD,), float("nan"))
            threads = 1 + rows % 3  # 1-3 threads, more than the panels for the narrow weights
            rc = call(kernel, x_buf.data_ptr(), rows, in_features, packed_buf.data_ptr(),
                      None if bias_buf is None else bias_buf.data_ptr(), out_features, y_buf.data_ptr(), threads)
            assert rc == 0
            y = y_buf[: rows * out_features].view(rows, out_features)
            case = f"{rows} x {in_features} -> {out_features}, bias {bias_on}"
            assert torch.isfinite(y).all(), f"{case}: NaN in y (an unwritten output, or a pad or guard read)"
            assert torch.isnan(y_buf[rows * out_features:]).all(), f"{case}: wrote past the end of y"
            expected, tol = reference(x, w, bias)
            err = (y.double() - expected).abs()
            assert (err <= tol).all(), f"{case}: error {(err / tol).max().item():.3g} x the bound"


def test_packed_layout_is_panels_padded_with_zeros(kernel):
    for out_features in OUT_FEATURES:
        w = torch.randn(out_features, 5) + 10.0  # no zero in the weight itself
        packed = kernel.pack(w)
        panels = -(-out_features // kernel.panel)
        assert packed.shape == (panels, 5, kernel.panel) and packed.is_contiguous()
        for p in range(panels):
            for j in range(kernel.panel):
                column = p * kernel.panel + j
                expected = w[column] if column < out_features else torch.zeros(5)
                assert torch.equal(packed[p, :, j], expected), f"N={out_features}: panel {p}, column {j}"


def test_pack_of_a_non_contiguous_weight(kernel):
    w = torch.randn(40, 96)[:, ::2]  # [40, 48] with stride 2
    x = torch.randn(9, 48)
    got = kernel.linear(x, kernel.pack(w), None, 40)
    expected, tol = reference(x, w, None)
    assert ((got.double() - expected).abs() <= tol).all()


@pytest.mark.parametrize("shape", [(2, 7), (1, 0), (3, 1), (2, 35)], ids=["2x7", "empty", "3x1", "2x35"])
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed"])
def test_linear_on_3d_and_non_contiguous_inputs(kernel, shape, layout):
    gen = torch.Generator().manual_seed(sum(shape))
    k, n = 48, 17
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    if layout == "contiguous":
        x = torch.randn(*shape, k, generator=gen)
    elif layout == "strided":
        x = torch.randn(*shape, 2 * k, generator=gen)[..., ::2]
    else:
        x = torch.randn(shape[1], shape[0], k, generator=gen).transpose(0, 1)
    assert x.shape == (*shape, k)
    for b in (None, bias):
        got = kernel.linear(x, kernel.pack(w), b, n)
        assert got.shape == (*shape, n) and got.dtype == torch.float32
        expected, tol = reference(x, w, b)
        assert ((got.double() - expected).abs() <= tol).all()


def test_bad_sizes_return_nonzero(kernel):
    w = kernel.pack(torch.randn(16, 8))
    x, y = torch.randn(4, 8), torch.full((64,), float("nan"))
    for rows, k, n in ((-1, 8, 16), (4, 0, 16), (4, -3, 16), (4, 8, 0), (4, 8, -16), (4, 2**31, 16),
                       (4, 8, 2**31)):
        assert call(kernel, x.data_ptr(), rows, k, w.data_ptr(), None, n, y.data_ptr(), 1) != 0, (rows, k, n)
    assert torch.isnan(y).all(), "a rejected call wrote to y"
    assert call(kernel, x.data_ptr(), 4, 8, w.data_ptr(), None, 16, y.data_ptr(), 0) == 0  # (threads < 1: one)
    with pytest.raises(ValueError, match="rejected 0 x 0 -> 16"):
        kernel.linear(torch.randn(4, 0), w, None, 16)
