"""Bad input gets a clear error, and never disturbs the requests that are fine."""

from __future__ import annotations

import pytest

from conftest import hf_greedy, random_prompts
from pagedkv import LLM, Engine, EngineConfig, SamplingParams
from pagedkv.core.errors import ConfigError, RequestRejected


def test_overlong_prompt_is_rejected_and_others_keep_running(tiny_llama):
    good = random_prompts([10], seed=3)[0]
    expected = hf_greedy(tiny_llama, good, 8)
    engine = Engine(EngineConfig(device="cpu", num_blocks=64, block_size=4, max_model_len=100), model=tiny_llama)
    rid = engine.add_request(good, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(RequestRejected, match="max_model_len=100"):
        engine.add_request(list(range(1, 102)), SamplingParams(max_tokens=4))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs[rid].token_ids == expected
    assert engine.pool.num_free == engine.num_blocks


def test_prompt_larger_than_the_whole_kv_cache_is_rejected(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", num_blocks=4, block_size=4), model=tiny_llama)
    with pytest.raises(RequestRejected, match="whole KV cache holds only 16"):
        engine.add_request(list(range(1, 30)))
    assert not engine.has_unfinished()


def test_kv_budget_below_one_block_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match="below one block"):
        Engine(EngineConfig(device="cpu", kv_cache_memory="1KiB"), model=tiny_llama)


def test_unknown_backend_names_the_available_ones(tiny_llama):
    with pytest.raises(ConfigError, match=r"unknown backend 'nope'; available: .*torch"):
        Engine(EngineConfig(device="cpu", backend="nope"), model=tiny_llama)


def test_empty_prompt_is_rejected(tiny_llama):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=16)
    with pytest.raises(RequestRejected, match="empty"):
        llm.generate([[]])
    with pytest.raises(RequestRejected, match="empty"):
        llm.engine.add_request([])


def test_a_bad_prompt_in_a_batch_fails_before_any_work(tiny_llama):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=16)
    with pytest.raises(RequestRejected, match="token ids"):
        llm.generate([[1, 2, 3], [1, 10**6]])
    assert not llm.engine.has_unfinished()
    assert llm.engine.stats.requests == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 257}, "block_size"),
        ({"num_blocks": 4, "kv_cache_memory": 1000}, "only one of"),
        ({"dtype": "float16", "device": "cpu"}, "only on CUDA"),
        ({"dtype": "int8"}, "unknown dtype"),
        ({"gpu_memory_utilization": 0.5, "device": "cpu"}, "CUDA"),
        ({"kv_cache_memory": "lots"}, "size in bytes"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_invalid_config_is_refused_on_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"n": 0}, {"top_k": -2}, {"stop": [""]}]
)
def test_invalid_sampling_params_are_refused(kwargs):
    with pytest.raises(RequestRejected):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_refused(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", num_blocks=16), model=tiny_llama)
    engine.add_request([1, 2], request_id="x")
    with pytest.raises(RequestRejected, match="already in use"):
        engine.add_request([3, 4], request_id="x")


def test_abort_frees_the_request_blocks_mid_decode(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", num_blocks=32, block_size=4), model=tiny_llama)
    a = engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=50, ignore_eos=True))
    b = engine.add_request(list(range(1, 6)), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.abort(a)
    assert not engine.abort("unknown")
    engine.check_invariants()
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.num_blocks
    assert b not in engine.requests


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="neither a local model directory"):
        Engine(EngineConfig(device="cpu", model=str(tmp_path / "nope")))


def test_a_model_that_is_not_a_causal_lm_is_a_clear_error(tmp_path):
    from transformers import BertConfig

    BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="cannot load a causal LM"):
        Engine(EngineConfig(device="cpu", model=str(tmp_path)))


def test_corrupt_safetensors_is_a_clear_error(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ConfigError, match="cannot load a causal LM"):
        Engine(EngineConfig(device="cpu", model=str(tmp_path)))


def test_corrupt_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ConfigError, match="cannot read .*broken.gguf as a GGUF model"):
        Engine(EngineConfig(device="cpu", model=str(bad)))


def test_a_surrogate_prompt_and_a_chat_message_without_content_are_request_rejected():
    from pagedkv.core.errors import RequestRejected
    from pagedkv.core.llm import LLM
    from pagedkv.serve.testing import byte_level_tokenizer
    from pagedkv.testing import tiny_llama as make_tiny

    tokenizer = byte_level_tokenizer()
    llm = LLM(hf_model=make_tiny(vocab_size=len(tokenizer)), tokenizer=tokenizer, device="cpu", num_blocks=32,
              block_size=8)
    with pytest.raises(RequestRejected, match="surrogate"):
        llm.generate("hello \ud800")
    with pytest.raises(RequestRejected, match="content"):
        llm.chat([{"role": "user"}])
    with pytest.raises(RequestRejected, match="surrogate"):
        llm.chat([{"role": "user", "content": "\udfff"}])
    assert llm.engine.pool.num_available == llm.engine.num_blocks
