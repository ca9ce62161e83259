"""The cpu backend's fused Llama layer on GGUF blocks (``quant_linear.h``'s layer calls, ``quant_layers.py``) against
the op-by-op layer (torch: de-quantize, then multiply) on tiny GGUF models of every format, for every build this
CPU runs: rows 1, 5, 13 and 61 (past the 60-row chunk), fresh random activations; and the engine picks it."""

from __future__ import annotations

import pytest
import torch

from conftest import cpu_kernel_build
from pagedkv.backends.cpu import build
from pagedkv.backends.cpu.quant_layers import CpuQuantLlamaLayers
from pagedkv.core.model.gguf_loader import load_gguf_llama
from pagedkv.core.model.llama_model import rotate_half
from pagedkv.core.model.quant_formats import FORMATS

pytest.importorskip("gguf")
from tiny_gguf import save_tiny_gguf  # noqa: E402 - needs gguf


@pytest.fixture(scope="module", params=build.checked_variants())
def layers(request) -> CpuQuantLlamaLayers:
    return CpuQuantLlamaLayers(cpu_kernel_build(request.param))


@pytest.fixture(scope="module", params=list(FORMATS))
def model(request, tmp_path_factory):
    gguf_dir, _ = save_tiny_gguf(tmp_path_factory.mktemp(request.param), request.param, intermediate_size=160)
    return load_gguf_llama(gguf_dir, torch.float32, "cpu")


def _rotary(rows: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 6.28
    emb = torch.cat([angles, angles], -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("rows", [1, 5, 13, 61])
def test_fused_layer_matches_the_op_by_op_layer(layers, model, rows):
    layer = model.model.layers[1]
    attn = layer.self_attn
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(1, rows, model.config.hidden_size, generator=gen)
    cos, sin = _rotary(rows, attn.head_dim, gen)
    assert layers.accepts(layer, h)
    q, k, v = layers.attention_inputs(layer, h, cos[None], sin[None])
    with torch.inference_mode():
        xn = layer.input_layernorm(h)[0]
        want = [m(xn).view(rows, -1, attn.head_dim) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        c, s = cos[:, None], sin[:, None]
        want[0], want[1] = want[0] * c + rotate_half(want[0]) * s, want[1] * c + rotate_half(want[1]) * s
        for got, ref in zip((q, k, v), want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        attn_out = torch.randn(rows, q.shape[1], attn.head_dim, generator=gen)
        mid = h + attn.o_proj(attn_out.reshape(1, rows, -1))
        ref_h = mid + layer.mlp(layer.post_attention_layernorm(mid))
    got_h = layers.mlp(layer, h.clone(), attn_out)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-4, atol=1e-4)


def test_layers_it_cannot_take_are_refused(layers, model):
    layer = model.model.layers[0]
    assert not layers.accepts(layer, torch.zeros(1, 3, model.config.hidden_size, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not take this layer"):
        layers.mlp(layer, torch.zeros(1, 3, model.config.hidden_size), torch.zeros(3, 64))


def test_the_engine_runs_quantized_layers_fused(model, tmp_path):
    from pagedkv.backends.cpu.backend import CpuBackend
    from pagedkv.core.kv.kv_cache import KVCacheSpec
    from pagedkv.core.model.model_runner import ModelRunner

    runner = ModelRunner(model, CpuBackend(), KVCacheSpec.from_model_config(model.config, 4, torch.float32), 8,
                         "cpu")
    assert isinstance(runner.layer_kernel, CpuQuantLlamaLayers) and runner.quant_kernel is not None
