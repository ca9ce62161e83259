"""The cpu backend's fused Llama layer on a bf16 layer (bf16 weights and activations; fp32 arithmetic inside, on
linear.h's bf16 panels) against the float64 reference of test_cpu_llama_layer.py, for every build this CPU runs:
the AVX-512-BF16 build's vdpbf16ps path (its normed activations rounded to bf16) and every other build's widened
weights; scratch poisoned with NaN."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_cpu_llama_layer import (  # noqa: F401 - poisoned_scratch is an autouse fixture here too
    ROWS,
    SHAPES,
    attention_inputs64,
    make_layer,
    mlp64,
    poisoned_scratch,
    rotary,
)

from conftest import cpu_kernel_build
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.linear import CpuLinearKernel
from pagedkv.backends.cpu.llama_layers import CpuLlamaLayers

# The bound's factor on the fp32 one: the fp32 sums, plus (vdpbf16ps) the bf16 rounding of each product's input,
# relative 2^-8, and the bf16 rounding of the outputs. A wrong layout or pad is an error of the size itself.
BF16_INPUTS = 2.0**-6


# A new wrapper for every test (the library is built once): the scratch it keeps between calls is then made
# under the poisoned_scratch fixture, so a value read before it is written shows in every test.
@pytest.fixture(params=build.checked_variants())
def layers(request) -> CpuLlamaLayers:
    lib = cpu_kernel_build(request.param)
    return CpuLlamaLayers(lib, CpuLinearKernel(lib))


def bf16_layer(shape: str, seed: int):
    return make_layer(*SHAPES[shape], seed=seed).bfloat16()


def assert_bf16_within(got, expected, fp32_tol, roundings: int, what: str) -> None:
    """``fp32_tol`` is the fp32 reference bound, ``4 (roundings + 8) eps size``: ``size`` is recovered from it."""
    assert got.dtype == torch.bfloat16, what
    assert torch.isfinite(got).all(), f"{what}: NaN or inf (a scratch value read before it was written?)"
    size = fp32_tol / (4 * (roundings + 8) * torch.finfo(torch.float32).eps)
    tol = fp32_tol + BF16_INPUTS * size + 2.0**-8 * expected.abs()
    err = (got.double() - expected).abs()
    assert (err <= tol).all(), f"{what}: error {(err / tol).max().item():.3g} x the bound"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_attention_inputs_match_float64(layers, shape, rows):
    layer = bf16_layer(shape, rows)
    h = torch.randn(1, rows, layer.self_attn.q_proj.in_features).bfloat16()
    cos, sin = (t.bfloat16() for t in rotary(rows, layer.self_attn.head_dim, seed=rows))
    before = h.clone()
    assert layers.accepts(layer, h), "a bf16 layer on bf16 activations takes the kernel"
    got = layers.attention_inputs(layer, h, cos, sin)
    assert torch.equal(h, before), "attention_inputs changed h"
    for name, tensor, (expected, tol) in zip("qkv", got, attention_inputs64(layer, h, cos, sin)):
        assert tensor.shape == expected.shape, name
        assert_bf16_within(tensor, expected, tol, 2 * h.shape[-1], f"{shape}, {rows} rows: {name}")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_bf16_mlp_matches_float64(layers, shape, rows):
    layer = bf16_layer(shape, 100 + rows)
    hidden = layer.self_attn.q_proj.in_features
    h = torch.randn(1, rows, hidden).bfloat16()
    attn_out = torch.randn(rows, layer.self_attn.q_proj.out_features // layer.self_attn.head_dim,
                           layer.self_attn.head_dim).bfloat16()
    expected, tol = mlp64(layer, h, attn_out)
    assert layers.accepts(layer, h)
    out = layers.mlp(layer, h, attn_out)
    assert out is h, "h is updated in place"
    inner = layer.self_attn.q_proj.out_features + 2 * hidden + layer.mlp.down_proj.in_features
    assert_bf16_within(out, expected, tol, inner, f"{shape}, {rows} rows: mlp")


def test_bf16_layer_refuses_fp32_activations_and_mixed_weights(layers):
    layer = bf16_layer("gqa_hd8", 0)
    assert not layers.accepts(layer, torch.randn(1, 3, 48)), "fp32 activations on a bf16 layer"
    layer.mlp.down_proj.float()
    assert not layers.accepts(layer, torch.randn(1, 3, 48).bfloat16()), "weights of two dtypes"


def test_a_layer_cast_to_bf16_after_packing_is_repacked(layers):
    # Module.to / .bfloat16() give the parameters new data in place of the old (no registration): the plan
    # must see it
    layer = make_layer(*SHAPES["gqa_hd8"], seed=3)
    h = torch.randn(1, 5, 48)
    cos, sin = rotary(5, 8, seed=3)
    assert layers.accepts(layer, h)
    layers.attention_inputs(layer, h, cos, sin)  # packs the fp32 layer
    layer.bfloat16()
    assert not layers.accepts(layer, h), "fp32 activations on the now bf16 layer"
    h16, cos16, sin16 = h.bfloat16(), cos.bfloat16(), sin.bfloat16()
    assert layers.accepts(layer, h16)
    for name, tensor, (expected, tol) in zip("qkv", layers.attention_inputs(layer, h16, cos16, sin16),
                                              attention_inputs64(layer, h16, cos16, sin16)):
        assert_bf16_within(tensor, expected, tol, 2 * 48, f"after the cast: {name}")


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch calls that make or convert tensors while it is active (not attribute reads)."""

    READS = frozenset({"__get__", "data_ptr", "is_contiguous", "is_inference", "dim", "size"})

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in self.READS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_bf16_decode_layers_make_only_their_output_tensors(layers):
    """At one row, a bf16 layer's attention inputs make only their output and its views (the kernel reads bf16 h,
    cos and sin and writes bf16 q/k/v itself; ~1 us a torch call, 4 of them a layer before, and more before that,
    a measurable share of a 9 ms bf16 SmolLM2 step); the results stay those of fresh calls."""
    stack = [bf16_layer("gqa_hd64", seed) for seed in range(3)]
    h = torch.randn(1, 1, stack[0].self_attn.q_proj.in_features).bfloat16()
    tables = [[t.bfloat16() for t in rotary(1, stack[0].self_attn.head_dim, seed=s)] for s in (7, 8)]
    for step, (cos, sin) in enumerate(tables):  # a step that packs the layers, then the counted one
        counter = _TorchCalls()
        got = []
        for i, layer in enumerate(stack):
            assert layers.accepts(layer, h)
            with counter if step == 1 and i > 0 else contextlib.nullcontext():
                got.append(layers.attention_inputs(layer, h, cos, sin))
    made = [name for name in counter.names if name not in POISON_CALLS]
    assert made == ["empty", "view", "split"] * 2, f"torch calls of the step's 2nd and 3rd layers: {made}"
    for layer, mine in zip(stack, got):
        fresh = CpuLlamaLayers(layers.lib, layers.linear)  # (nothing kept from another call)
        assert fresh.accepts(layer, h)
        for a, b in zip(mine, fresh.attention_inputs(layer, h, *tables[1])):
            assert torch.equal(a, b)


POISON_CALLS = frozenset({"is_floating_point", "fill_"})  # (the poisoned_scratch fixture's own calls)
