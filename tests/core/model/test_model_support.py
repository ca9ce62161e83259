"""A model feature the engine does not implement is refused at load, by name; supported ones are described."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import VOCAB
from pagedkv import LLM
from pagedkv.core.errors import ConfigError
from pagedkv.core.model.model_support import (
    LayerAttention,
    UnsupportedModelError,
    check_model_support,
    config_problems,
    expected_layers,
)


def cfg(**fields) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=2, **fields)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"is_encoder_decoder": True}, "encoder-decoder"),
        ({"add_cross_attention": True}, "cross-attention"),
        ({"alibi": True}, "ALiBi"),
        ({"model_type": "bloom"}, "ALiBi"),
        ({"position_embedding_type": "alibi"}, "ALiBi"),
        ({"attention_chunk_size": 8192}, "chunked attention"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"layer_types": ["full_attention", "linear_attention"]}, "linear_attention"),
        ({"sliding_window": 0}, "sliding_window=0"),
    ],
)
def test_config_features_the_engine_lacks_are_named(fields, named):
    problems = config_problems(cfg(**fields))
    assert len(problems) == 1 and named in problems[0]


def test_plain_configs_have_no_problems():
    assert config_problems(cfg(sliding_window=None, layer_types=["full_attention", "sliding_attention"])) == []


def test_expected_layers_follow_layer_types_or_one_window_for_all():
    gemma_like = cfg(sliding_window=4, attn_logit_softcapping=50.0, layer_types=["sliding_attention", "full_attention"])
    assert expected_layers(gemma_like) == (LayerAttention(4, 50.0), LayerAttention(None, 50.0))
    assert expected_layers(cfg(sliding_window=4)) == (LayerAttention(4), LayerAttention(4))  # Mistral
    assert expected_layers(cfg(sliding_window=None)) == (LayerAttention(), LayerAttention())


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )).eval()


def test_supported_models_pass_and_describe_their_layers(tiny_models):
    from test_sliding_window import tiny_gemma2, tiny_qwen2

    for model in tiny_models.values():
        assert set(check_model_support(model)) == {LayerAttention()}
    assert check_model_support(tiny_gemma2()) == (LayerAttention(6, 0.5), LayerAttention(None, 0.5),
                                                  LayerAttention(6, 0.5))
    assert check_model_support(tiny_qwen2()) == (LayerAttention(), LayerAttention(6), LayerAttention(6))


def test_alibi_model_is_refused_when_the_engine_is_built():
    from transformers import BloomConfig, BloomForCausalLM

    model = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)).eval()
    with pytest.raises(ConfigError, match="'bloom' uses ALiBi position biases, which pagedkv does not implement"):
        LLM(hf_model=model, device="cpu", num_blocks=8)


def test_a_window_the_layers_are_not_told_is_refused():
    model = tiny_llama()
    model.config.sliding_window = 4  # transformers' masks would use it; Llama's attention is never told
    with pytest.raises(UnsupportedModelError, match="layer 0: a sliding window of 4 in its config but None passed"):
        check_model_support(model)


def test_layers_without_attention_are_refused():
    model = tiny_llama()
    model.model.layers = model.model.layers[:1]  # as in a hybrid model: layer 1 never calls attention
    with pytest.raises(UnsupportedModelError, match=r"layers without standard attention \[1\]"):
        check_model_support(model)


def test_keys_unlike_the_cache_are_refused():
    model = tiny_llama()
    model.config.num_key_value_heads = 1  # the KV cache would be sized for 1 head; the layers produce 2
    with pytest.raises(UnsupportedModelError, match=r"keys \(2, 8\)"):
        check_model_support(model)


def test_attention_sinks_are_refused():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers has no GPT-OSS")
    config = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
        pad_token_id=0,
    )
    model = transformers.GptOssForCausalLM(config).eval()
    with pytest.raises(UnsupportedModelError, match="s_aux"):
        check_model_support(model)


def test_the_probe_runs_on_one_thread_and_restores_the_count():
    """Start-up: the probe's 2-token forward gains nothing from threads and, on a busy machine, loses seconds."""
    from pagedkv.testing import tiny_llama

    model = tiny_llama()
    seen: list[int] = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_model_support(model)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
