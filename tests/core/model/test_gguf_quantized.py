"""``quantization="gguf"``: a GGUF file's Q8_0 / Q4_0 / Q4_1 weights run as their blocks, on tiny random Llamas
written by the ``gguf`` package (tests/tiny_gguf.py), against the same weights de-quantized to fp32 safetensors:
equal logits (bit for bit on the torch backend, which de-quantizes then multiplies; to rounding on the cpu
backend's kernel), equal greedy tokens, weights held at the file's size, other tensor types de-quantized at load
with a log line, and other quantization methods refused by name."""

from __future__ import annotations

import logging

import pytest
import torch
from tiny_checkpoint import BLOCK

from conftest import drain, random_prompts
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.errors import ConfigError
from pagedkv.core.model.gguf_loader import load_gguf_llama
from pagedkv.core.model.native_loader import load_native_llama
from pagedkv.core.model.quant_formats import FORMATS
from pagedkv.core.model.quant_linear import QuantEmbedding, QuantLinear, weight_bytes
from pagedkv.core.sample.sampling_params import SamplingParams

gguf = pytest.importorskip("gguf")
from tiny_gguf import save_tiny_gguf  # noqa: E402 - needs gguf

PROMPTS = random_prompts([5, 11, 3], seed=3)


def load_native(path):
    return load_native_llama(path, torch.float32, "cpu")


@pytest.fixture(scope="module", params=list(FORMATS))
def pair(request, tmp_path_factory):
    """(format, GGUF model directory, its fp32 de-quantization)."""
    gguf_dir, fp32_dir = save_tiny_gguf(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, gguf_dir, fp32_dir


def _engine(path, backend, quantization=None):
    return Engine(EngineConfig(model=str(path), quantization=quantization, backend=backend, device="cpu",
                               num_blocks=64, block_size=BLOCK))


def _greedy(engine):
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    results, _ = drain(engine)
    assert engine.pool.num_free == engine.num_blocks, "blocks leaked after the run"
    return [results[k].token_ids for k in sorted(results)]


def test_the_blocks_are_kept_and_the_model_is_the_file_size(pair):
    qtype, gguf_dir, _ = pair
    model = load_gguf_llama(gguf_dir, torch.float32, "cpu")
    layer = model.model.layers[0]
    linears = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.down_proj, model.lm_head)
    assert all(isinstance(m, QuantLinear) and m.qtype == qtype for m in linears)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert model.lm_head.blocks.data_ptr() == model.model.embed_tokens.blocks.data_ptr()  # tied: one copy
    assert weight_bytes(model) <= 1.15 * (gguf_dir / "model.gguf").stat().st_size


def test_plain_forward_is_bit_identical_to_the_fp32_dequantization(pair):
    """Outside the engine (no packed or kernel linears) the blocks are de-quantized and multiplied as the fp32
    model multiplies its weights: the same logits bit for bit, so the two are one model."""
    from pagedkv.core.model.native_loader import load_native_llama

    _, gguf_dir, fp32_dir = pair
    ids = torch.tensor([PROMPTS[1]])
    with torch.inference_mode():
        quantized = load_gguf_llama(gguf_dir, torch.float32, "cpu")(ids).logits
        reference = load_native_llama(fp32_dir, torch.float32, "cpu")(ids).logits
    assert torch.equal(quantized, reference)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_engine_logits_equal_the_fp32_dequantization(pair, backend):
    """One prefill step of three prompts in the engine: the blocks (torch: de-quantized then MKL; cpu: the
    kernel) against the fp32 weights (oneDNN or the cpu backend's packed kernels): equal to fp32 rounding."""
    _, gguf_dir, fp32_dir = pair
    logits = []
    for path, quantization in ((gguf_dir, "gguf"), (fp32_dir, None)):
        engine = _engine(path, backend, quantization)
        for prompt in PROMPTS:
            engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        logits.append(engine.runner.execute(engine.scheduler.schedule()))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_tokens_equal_the_fp32_dequantization(pair, backend):
    _, gguf_dir, fp32_dir = pair
    assert _greedy(_engine(gguf_dir, backend, "gguf")) == _greedy(_engine(fp32_dir, backend))


def test_the_quantized_model_is_not_the_fp32_one(pair):
    """The comparison above can fail: the fp32 model of another seed gives other tokens."""
    qtype, gguf_dir, _ = pair
    _, other = save_tiny_gguf(gguf_dir.parent / "other", qtype, seed=1)
    assert _greedy(_engine(gguf_dir, "torch", "gguf")) != _greedy(_engine(other, "torch"))


def test_an_untied_output_weight_is_its_own_quantized_linear(tmp_path):
    gguf_dir, fp32_dir = save_tiny_gguf(tmp_path, "Q8_0", tie_word_embeddings=False)
    model = load_gguf_llama(gguf_dir, torch.float32, "cpu")
    assert isinstance(model.lm_head, QuantLinear)
    assert model.lm_head.blocks.data_ptr() != model.model.embed_tokens.blocks.data_ptr()
    assert _greedy(_engine(gguf_dir, "cpu", "gguf")) == _greedy(_engine(fp32_dir, "cpu"))


def test_other_types_are_dequantized_at_load_with_a_log_line(tmp_path, caplog):
    gguf_dir, fp32_dir = save_tiny_gguf(tmp_path, "Q4_1", other={"blk.0.ffn_up.weight": "Q5_0",
                                                                 "blk.1.attn_v.weight": "F16"})
    with caplog.at_level(logging.INFO, logger="pagedkv.model"):
        model = load_gguf_llama(gguf_dir, torch.float32, "cpu")
    assert "blk.0.ffn_up.weight is Q5_0" in caplog.text and "de-quantized to float32" in caplog.text
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.gate_proj, QuantLinear)
    assert _greedy(_engine(gguf_dir, "cpu", "gguf")) == _greedy(_engine(fp32_dir, "cpu"))


def test_k_quants_are_dequantized_at_load_with_a_log_line_naming_them(tmp_path, caplog):
    """Q4_K / Q5_K / Q6_K (of Q4_K_M, Q5_K_M, Q6_K files) have no kernel here: de-quantized at load, said so."""
    kinds = {"blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q5_K", "blk.2.ffn_down.weight": "Q6_K"}
    gguf_dir, fp32_dir = save_tiny_gguf(tmp_path, "Q8_0", other=kinds, intermediate_size=256, num_hidden_layers=3)
    with caplog.at_level(logging.INFO, logger="pagedkv.model"):
        model = load_gguf_llama(gguf_dir, torch.float32, "cpu")
    for name, kind in kinds.items():
        assert f"{name} is {kind}, not a format kept quantized" in caplog.text
    downs = [layer.mlp.down_proj for layer in model.model.layers]
    assert all(type(m) is torch.nn.Linear for m in downs)
    assert isinstance(model.model.layers[2].mlp.up_proj, QuantLinear)
    fp32 = load_native(fp32_dir)
    for ours, theirs in zip(downs, (layer.mlp.down_proj for layer in fp32.model.layers)):
        assert ours.weight.abs().max() > 0 and torch.equal(ours.weight, theirs.weight)
    assert _greedy(_engine(gguf_dir, "torch", "gguf")) == _greedy(_engine(fp32_dir, "torch"))


@pytest.mark.parametrize("method", ["awq", "int3", "fp8"])
def test_other_quantization_methods_are_refused_by_name(method):
    with pytest.raises(ConfigError, match=f"quantization '{method}' is not implemented"):
        EngineConfig(quantization=method, device="cpu")


def test_gguf_quantization_of_a_safetensors_model_is_refused(pair):
    _, _, fp32_dir = pair
    with pytest.raises(ConfigError, match="quantization gguf runs a .gguf file"):
        _engine(fp32_dir, "torch", "gguf")

