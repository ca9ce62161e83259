"""The cpu backend's fused Llama layer (``llama_block.h`` through ``CpuLlamaLayers``) against a float64 op-by-op
reference of the layer's math, for every build this CPU runs: GQA / MQA / MHA, head dims 8 / 24 / 64, rows
around the register tile, the parallel threshold and the row chunk, scratch poisoned with NaN; the SiLU at its
extremes; what ``accepts`` refuses; repacking after a weight changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import cpu_kernel_build
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.linear import CpuLinearKernel
from pagedkv.backends.cpu.llama_layers import CpuLlamaLayers
from pagedkv.core.model.llama_model import DecoderLayer, rotary_inv_freq

ROWS = [1, 7, 16, 17, 70, 121]  # 70, 121: a long input goes through 60 rows at a time (last chunk 10, 1)
EPS32 = torch.finfo(torch.float32).eps
# (hidden, heads, kv heads, head dim, intermediate)
SHAPES = {
    "gqa_hd8": (48, 6, 2, 8, 80),
    "mqa_hd24": (72, 3, 1, 24, 100),
    "mha_hd24": (96, 4, 4, 24, 61),
    "gqa_hd64": (64, 2, 1, 64, 96),
}


# A new wrapper for every test (the library is built once): the scratch it keeps between calls is then made
# under the poisoned_scratch fixture, so a value read before it is written shows in every test.
@pytest.fixture(params=build.checked_variants())
def layers(request) -> CpuLlamaLayers:
    isa = request.param
    lib = cpu_kernel_build(isa)
    return CpuLlamaLayers(lib, CpuLinearKernel(lib))


@pytest.fixture(autouse=True)
def poisoned_scratch(monkeypatch):
    """Every float tensor ``torch.empty`` makes during a test is NaN: the kernel's scratch (xn, gu) and outputs
    (qkv, y), so a value read before it is written shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty", empty)


def make_layer(hidden, heads, kv_heads, head_dim, inter, seed=0, eps=1e-6) -> DecoderLayer:
    config = SimpleNamespace(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim, intermediate_size=inter, rms_norm_eps=eps)
    torch.manual_seed(seed)
    layer = DecoderLayer(config, 0)
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return layer


def rotary(rows: int, head_dim: int, seed: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[1, rows, head_dim]`` as ``LlamaForCausalLM.forward`` makes them, for random positions."""
    positions = torch.randint(0, 4096, (1, rows), generator=torch.Generator().manual_seed(seed))
    freqs = positions[..., None].float() * rotary_inv_freq(theta, head_dim)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double()


def rms_norm64(x: torch.Tensor, norm) -> torch.Tensor:
    return d(norm.weight) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)


def rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x cos + rotate_half(x) sin`` on ``[T, heads, D]``, cos/sin ``[T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def attention_inputs64(layer, h, cos, sin):
    """float64 q, k, v ``[T, heads, D]`` and, for each, an fp32 error bound: doubled roundings of the norm
    (``hidden``) and the product (``hidden``) relative to the magnitudes the rotation combines."""
    attn, rows = layer.self_attn, h.shape[-2]
    xn = rms_norm64(d(h)[0], layer.input_layernorm)
    cos64, sin64 = d(cos)[0], d(sin)[0]
    out = []
    for proj, rotate in ((attn.q_proj, True), (attn.k_proj, True), (attn.v_proj, False)):
        y = (xn @ d(proj.weight).T).view(rows, -1, attn.head_dim)
        size = (xn.abs() @ d(proj.weight).abs().T).view(rows, -1, attn.head_dim)
        if rotate:
            y = rotate64(y, cos64, sin64)
            half = attn.head_dim // 2
            size = torch.cat((size[..., half:], size[..., :half]), -1) + size  # |cos|, |sin| <= 1
        out.append((y, 4 * (2 * h.shape[-1] + 8) * EPS32 * size + 1e-30))
    return out


def mlp64(layer, h, attn_out):
    """float64 ``h + o(attn) + MLP(norm(h + o(attn)))`` and an fp32 error bound from first-order magnitudes."""
    rows, attn_flat = h.shape[-2], d(attn_out).reshape(h.shape[-2], -1)
    wo, wg, wu, wd = (d(m.weight) for m in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                                             layer.mlp.down_proj))
    h1 = d(h)[0] + attn_flat @ wo.T
    xn = rms_norm64(h1, layer.post_attention_layernorm)
    gate, up = xn @ wg.T, xn @ wu.T
    act = torch.nn.functional.silu(gate) * up
    out = h1 + act @ wd.T
    size_h1 = d(h)[0].abs() + attn_flat.abs() @ wo.abs().T
    size_gate, size_up = xn.abs() @ wg.abs().T, xn.abs() @ wu.abs().T
    size_act = torch.nn.functional.silu(gate).abs() * size_up + 1.1 * size_gate * up.abs()
    size = size_h1 + size_act @ wd.abs().T
    inner = attn_flat.shape[-1] + 2 * h.shape[-1] + wd.shape[-1]
    return out.view(1, rows, -1), 4 * (inner + 8) * EPS32 * size.view(1, rows, -1) + 1e-30


def assert_within(got: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    assert torch.isfinite(got).all(), f"{what}: NaN or inf (a scratch value read before it was written?)"
    err = (got.double() - expected).abs()
    assert (err <= tol).all(), f"{what}: error {(err / tol).max().item():.3g} x the bound"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_attention_inputs_match_float64(layers, shape, rows):
    layer = make_layer(*SHAPES[shape], seed=rows)
    h = torch.randn(1, rows, layer.self_attn.q_proj.in_features)
    cos, sin = rotary(rows, layer.self_attn.head_dim, seed=rows)
    before = h.clone()
    assert layers.accepts(layer, h)
    got = layers.attention_inputs(layer, h, cos, sin)
    assert torch.equal(h, before), "attention_inputs changed h"
    for name, tensor, (expected, tol) in zip("qkv", got, attention_inputs64(layer, h, cos, sin)):
        assert tensor.shape == expected.shape, name
        assert_within(tensor, expected, tol, f"{shape}, {rows} rows: {name}")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_mlp_matches_float64(layers, shape, rows):
    layer = make_layer(*SHAPES[shape], seed=100 + rows)
    attn = layer.self_attn
    h = torch.randn(1, rows, attn.q_proj.in_features)
    attn_out = torch.randn(rows, attn.q_proj.out_features // attn.head_dim, attn.head_dim)
    expected, tol = mlp64(layer, h, attn_out)
    got = layers.mlp(layer, h, attn_out)
    assert got is h, "mlp updates h in place and returns it"
    assert_within(got, expected, tol, f"{shape}, {rows} rows")


def test_silu_at_extreme_gates(layers):
    # h = 2^-32 everywhere and no norm eps make xn = 1 exactly, gates of few mantissa bits make gate j = the
    # sum of Wg's row j exactly, up = 1 and down the identity: h's change is SiLU(gate) itself, rounded once.
    # The extremes sit in the vectorized part of a row and in the scalar tail (60 = 48 + 12 for AVX-512,
    # 56 + 4 for AVX2).
    hidden, inter = 64, 60
    special = torch.tensor([100.0, -100.0, 20.0, -20.0, 0.0, 88.5, -88.5, 2.0**-10])
    gates = torch.round(torch.randn(inter, generator=torch.Generator().manual_seed(5)) * 96) / 16
    gates[:8], gates[-8:] = special, special
    layer = make_layer(hidden, 2, 1, 32, inter, eps=0.0)
    with torch.no_grad():
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.gate_proj.weight.copy_(gates[:, None].expand(inter, hidden) / hidden)
        layer.mlp.up_proj.weight.fill_(1.0 / hidden)
        layer.mlp.down_proj.weight.copy_(torch.eye(hidden, inter))
    for rows in (1, 7, 17):
        h = torch.full((1, rows, hidden), 2.0**-32)
        expected, _ = mlp64(layer, h, torch.zeros(rows, 2, 32))
        got = layers.mlp(layer, h.clone(), torch.zeros(rows, 2, 32))
        assert torch.isfinite(got).all()
        err = (got.double() - expected).abs()[0, :, :inter]
        tol = 4e-6 * expected.abs()[0, :, :inter] + 1e-16
        worst = int((err / tol).amax(0).argmax())
        assert (err <= tol).all(), (f"SiLU({gates[worst].item():g}): got {got[0, 0, worst].item():.8g}, expected "
                                    f"{expected[0, 0, worst].item():.8g}")


def test_accepts_only_fp32_without_biases(layers):
    layer = make_layer(*SHAPES["gqa_hd8"])
    h = torch.randn(1, 5, 48)
    assert layers.accepts(layer, h)
    assert not layers.accepts(layer, h.bfloat16()), "bf16 activations"
    assert not layers.accepts(layer, torch.randn(1, 48, 5).transpose(1, 2)), "non-contiguous activations"
    assert not layers.accepts(make_layer(*SHAPES["gqa_hd8"]).to(torch.bfloat16), h), "bf16 weights"
    biased = make_layer(*SHAPES["gqa_hd8"])
    biased.self_attn.q_proj = torch.nn.Linear(48, 48, bias=True)
    assert not layers.accepts(biased, h), "a projection with a bias"
    biased = make_layer(*SHAPES["gqa_hd8"])
    biased.mlp.down_proj = torch.nn.Linear(80, 48, bias=True)
    assert not layers.accepts(biased, h), "an MLP projection with a bias"
    assert layers.accepts(layer, h), "a refused layer left the cache of an accepted one alone"


def test_a_replaced_weight_is_repacked(layers):
    layer = make_layer(*SHAPES["mqa_hd24"])
    h = torch.randn(1, 7, 72)
    cos, sin = rotary(7, 24, seed=1)
    attn_out = torch.randn(7, 3, 24)
    layers.attention_inputs(layer, h, cos, sin), layers.mlp(layer, h.clone(), attn_out)  # packs the layer
    layer.self_attn.k_proj.weight = torch.nn.Parameter(torch.randn(24, 72))
    layer.mlp.down_proj.weight = torch.nn.Parameter(torch.randn(72, 100))
    layer.input_layernorm.weight = torch.nn.Parameter(torch.rand(72) + 0.5)
    for name, tensor, (expected, tol) in zip("qkv", layers.attention_inputs(layer, h, cos, sin),
                                              attention_inputs64(layer, h, cos, sin)):
        assert_within(tensor, expected, tol, f"after replacing the weights: {name}")
    expected, tol = mlp64(layer, h, attn_out)
    assert_within(layers.mlp(layer, h.clone(), attn_out), expected, tol, "after replacing the weights: mlp")


def test_a_weight_changed_in_place_is_repacked(layers):
    # load_state_dict and tensor-parallel sharding copy into the existing parameters
    layer = make_layer(*SHAPES["gqa_hd8"])
    h = torch.randn(1, 7, 48)
    cos, sin = rotary(7, 8, seed=2)
    attn_out = torch.randn(7, 6, 8)
    layers.attention_inputs(layer, h, cos, sin), layers.mlp(layer, h.clone(), attn_out)
    with torch.no_grad():
        layer.self_attn.v_proj.weight.mul_(-2.0)
        layer.mlp.gate_proj.weight.copy_(torch.randn(80, 48))
    _, _, v = layers.attention_inputs(layer, h, cos, sin)
    expected, tol = attention_inputs64(layer, h, cos, sin)[2]
    assert_within(v, expected, tol, "v after v_proj.weight.mul_")
    expected, tol = mlp64(layer, h, attn_out)
    assert_within(layers.mlp(layer, h.clone(), attn_out), expected, tol, "mlp after gate_proj.weight.copy_")
