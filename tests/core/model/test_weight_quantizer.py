"""``quantization="int8"`` / ``"int4"``: a full-precision checkpoint quantized at load into Q8_0 / Q4_1 blocks, byte for
byte as the ``gguf`` package's reference quantizers (llama.cpp's) write them; the quantized model is the model of
those blocks (logits equal to the fp32 model of their de-quantization), close to the full-precision one, runs on
the cpu and torch backends, and nonsense is refused by name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from tiny_checkpoint import BLOCK, save_tiny

from conftest import drain, random_prompts
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine
from pagedkv.core.errors import ConfigError
from pagedkv.core.model.model_loader import load_model
from pagedkv.core.model.quant_linear import QuantEmbedding, QuantLinear, weight_bytes
from pagedkv.core.model.weight_quantizer import METHOD_FORMATS, quantize_weight
from pagedkv.core.sample.sampling_params import SamplingParams

gguf = pytest.importorskip("gguf")

PROMPTS = random_prompts([5, 11, 3], seed=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("fp32") / "tiny", hidden_size=64, intermediate_size=96,
                     tie_word_embeddings=True, initializer_range=0.3)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_blocks_equal_the_gguf_reference_quantizer_byte_for_byte(qtype):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 96, generator=g) * torch.rand(48, 1, generator=g) * 3
    w[0, :32] = 0  # an all-zero block: scale 0, no division by zero
    w[1, 5] = 40.0  # an outlier
    ours = quantize_weight(w, qtype).numpy()
    reference = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(ours, reference)


@pytest.mark.parametrize("method", list(METHOD_FORMATS))
def test_quantized_at_load_every_linear_and_the_embedding_in_blocks(checkpoint, method):
    fp32, _, _ = load_model(str(checkpoint), torch.float32, "cpu")
    full_bytes = weight_bytes(fp32)
    model, _, _ = load_model(str(checkpoint), torch.float32, "cpu", quantization=method)
    qtype = METHOD_FORMATS[method]
    layer = model.model.layers[1]
    linears = (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj)
    assert all(isinstance(m, QuantLinear) and m.qtype == qtype for m in linears)
    assert isinstance(model.model.embed_tokens, QuantEmbedding) and model.model.embed_tokens.qtype == "Q8_0"
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.qtype == "Q8_0"  # 8-bit logits, either method
    assert model.lm_head.blocks.data_ptr() == model.model.embed_tokens.blocks.data_ptr()  # tied: one copy
    assert model.dtype == torch.float32
    embedding = fp32.model.embed_tokens.weight.numel()
    expected = (full_bytes / 4 - embedding) * {"int8": 34, "int4": 20}[method] / 32 + embedding * 34 / 32
    assert expected < weight_bytes(model) < expected * 1.05  # block bytes; the norms stay fp32
    w = fp32.model.layers[1].mlp.down_proj.weight
    back = layer.mlp.down_proj.dequantized()
    tolerance = {"int8": 1 / 127, "int4": 1 / 15}[method]  # half a step of the block's range, with slack
    assert (back - w).abs().max() <= tolerance * w.abs().max()


def _greedy(engine):
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    results, _ = drain(engine)
    assert engine.pool.num_free == engine.num_blocks, "blocks leaked after the run"
    return [results[k].token_ids for k in sorted(results)]


def _dequantized_checkpoint(checkpoint, method, dest):
    """``checkpoint`` with every quantized weight replaced by its de-quantization: the model the blocks are."""
    from safetensors.torch import save_file

    shutil.copytree(checkpoint, dest)
    model, _, _ = load_model(str(checkpoint), torch.float32, "cpu", quantization=method)
    state = {f"{name}.weight": m.dequantized() for name, m in model.named_modules()
             if isinstance(m, QuantLinear) and name != "lm_head"}
    state["model.embed_tokens.weight"] = model.lm_head.dequantized()  # tied: lm_head is not saved
    state.update({name: p.detach().clone() for name, p in model.named_parameters()})  # the norms
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("method", list(METHOD_FORMATS))
def test_each_backend_runs_the_model_of_the_blocks(checkpoint, tmp_path, method, backend):
    def engine(path, quantization):
        return Engine(EngineConfig(model=str(path), quantization=quantization, backend=backend, device="cpu",
                                   num_blocks=64, block_size=BLOCK))

    same_weights = _dequantized_checkpoint(checkpoint, method, tmp_path / "dequantized")
    assert _greedy(engine(checkpoint, method)) == _greedy(engine(same_weights, None))


def test_int8_is_closer_to_full_precision_than_int4(checkpoint):
    ids = torch.tensor([random_prompts([64], seed=9)[0]])
    logits = {}
    for method in (None, "int8", "int4"):
        model, _, _ = load_model(str(checkpoint), torch.float32, "cpu", quantization=method)
        with torch.no_grad():
            logits[method] = model(ids).logits[0]
    agree = {m: (logits[m].argmax(-1) == logits[None].argmax(-1)).float().mean().item() for m in ("int8", "int4")}
    error = {m: (logits[m] - logits[None]).norm().item() for m in ("int8", "int4")}
    assert agree["int8"] >= 0.9 and error["int8"] < error["int4"] / 4


@pytest.mark.parametrize("value, named", [("int4_g128", "group 128"), ("awq", "'awq'"), ("fp8", "'fp8'")])
def test_a_method_not_implemented_is_refused_by_name(value, named):
    with pytest.raises(ConfigError, match="not implemented") as info:
        EngineConfig(quantization=value)
    assert named in str(info.value) and "int8" in str(info.value)


def test_int8_on_a_gguf_file_is_refused(tmp_path):
    path = tmp_path / "model.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    for model in (str(path), None):
        with pytest.raises(ConfigError, match="already quantized"):
            load_model(model, torch.float32, "cpu", quantization="int8")


@pytest.mark.parametrize("field", [{"tensor_parallel_size": 2, "model_impl": "transformers"},
                                   {"model_impl": "transformers"}])
def test_int4_with_tensor_parallel_or_transformers_is_refused(field):
    with pytest.raises(ConfigError, match="quantization int4 runs pagedkv's own Llama on one device"):
        EngineConfig(quantization="int4", **field)


def test_capacity_line_and_run_report_count_the_quantized_weight_bytes(checkpoint):
    from pagedkv.cli.run import capacity

    seen = {}
    for method in (None, "int8", "int4"):
        engine = Engine(EngineConfig(model=str(checkpoint), quantization=method, backend="torch", device="cpu",
                                     num_blocks=8, block_size=BLOCK))
        report = capacity(engine)
        assert report["weight_bytes"] == weight_bytes(engine.model)
        assert report["weight_formats"] == {None: [], "int8": ["Q8_0"], "int4": ["Q4_1", "Q8_0"]}[method]
        held = f"{', '.join(report['weight_formats'])} blocks" if method else "float32"
        assert engine.capacity_line().endswith(f"; weights {report['weight_bytes'] / 2**20:.1f} MiB ({held})")
        seen[method] = report["weight_bytes"]
    assert seen["int4"] < seen["int8"] < seen[None] / 3.5
