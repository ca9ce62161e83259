"""vLLM's request parameters in the engine itself: priority scheduling, prompt dicts, the KV peak, cut characters."""

from __future__ import annotations

import json

import pytest

from pagedkv import LLM, Engine, EngineConfig, SamplingParams
from pagedkv.core.errors import ConfigError, RequestRejected
from pagedkv.serve.testing import byte_level_tokenizer
from pagedkv.testing import tiny_llama as make_tiny_llama


def _drain(engine: Engine) -> list[str]:
    order = []
    while engine.has_unfinished():
        order += [out.request_id for out in engine.step(stream=False)]
    return order


def test_priority_scheduler_runs_lower_priority_first_and_fcfs_refuses_a_priority(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", num_blocks=64, block_size=4, max_num_seqs=1, scheduler="priority"),
                    model=tiny_llama)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for request_id, priority in (("late-a", 5), ("urgent", 0), ("late-b", 5), ("mid", 2)):
        engine.add_request([1, 2, 3], params, request_id=request_id, priority=priority)
    assert _drain(engine) == ["urgent", "mid", "late-a", "late-b"]
    assert engine.pool.num_available == engine.num_blocks
    fcfs = Engine(EngineConfig(device="cpu", num_blocks=64, block_size=4), model=tiny_llama)
    with pytest.raises(RequestRejected, match="priority"):
        fcfs.add_request([1, 2, 3], params, priority=1)


def test_priority_preemption_takes_the_least_urgent_running_sequence(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", num_blocks=6, block_size=4, scheduler="priority"), model=tiny_llama)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.add_request([1, 2, 3, 4], params, request_id="background", priority=9)
    engine.add_request([5, 6, 7, 8], params, request_id="urgent", priority=0)
    order = _drain(engine)
    assert order[0] == "urgent" and engine.stats.preemptions > 0
    assert engine.pool.num_available == engine.num_blocks


def test_prompt_dicts_as_vllm_takes_them(tiny_llama):
    llm = LLM(hf_model=tiny_llama, device="cpu", num_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=4)
    plain = llm.generate([[3, 4, 5]], params)[0].token_ids
    assert llm.generate({"prompt_token_ids": [3, 4, 5]}, params)[0].token_ids == plain
    assert llm.generate([{"prompt_token_ids": [3, 4, 5]}], params)[0].token_ids == plain
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        llm.generate({"tokens": [3, 4, 5]}, params)


def test_peak_kv_blocks_are_measured_before_finished_requests_free_theirs(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", num_blocks=64, block_size=16), model=tiny_llama)
    engine.add_request(list(range(1, 39)), SamplingParams(max_tokens=28, ignore_eos=True))
    _drain(engine)
    # 38 prompt + 27 cached generated tokens (the 28th is sampled, never cached) = 65 tokens = 5 blocks of 16
    assert engine.stats.peak_blocks_used == 5
    assert engine.stats.waste_at_peak == pytest.approx(1 - 65 / 80)


def test_a_character_cut_by_max_tokens_never_shows_as_a_replacement_character():
    tokenizer = byte_level_tokenizer()
    engine = Engine(EngineConfig(device="cpu", num_blocks=64, block_size=8),
                    model=make_tiny_llama(vocab_size=len(tokenizer)), tokenizer=tokenizer)
    first_byte = tokenizer("한", add_special_tokens=False)["input_ids"][0]
    engine.add_request("Hello", SamplingParams(max_tokens=2, allowed_token_ids=[first_byte], ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and "\ufffd" not in outs[-1].text and outs[-1].text == ""


@pytest.mark.parametrize(("field", "value"), [("bad_words", "word"), ("bad_words", [""]), ("allowed_token_ids", []),
                                              ("truncate_prompt_tokens", 0), ("skip_special_tokens", 1)])
def test_new_sampling_fields_are_checked(field, value):
    with pytest.raises(RequestRejected, match=field):
        SamplingParams(**{field: value})


def test_truncate_prompt_tokens_in_the_engine(tiny_llama):
    engine = Engine(EngineConfig(device="cpu", num_blocks=64, block_size=4), model=tiny_llama)
    rid = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=2, truncate_prompt_tokens=5))
    assert engine.requests[rid][0].prompt_token_ids == list(range(25, 30))


def test_max_model_len_the_cache_cannot_hold_is_a_start_up_error(tiny_llama):
    with pytest.raises(ConfigError, match="max_model_len 200 does not fit"):
        Engine(EngineConfig(device="cpu", num_blocks=10, block_size=16, max_model_len=200), model=tiny_llama)
    fitted = Engine(EngineConfig(device="cpu", num_blocks=10, block_size=16, max_model_len="auto"), model=tiny_llama)
    assert fitted.max_model_len == 160


def test_engine_run_shows_every_sample(tmp_path, capsys):
    from pagedkv.cli.main import main

    tokenizer = byte_level_tokenizer()
    make_tiny_llama(vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    argv = ["run", "--model", str(tmp_path), "--prompt", "Hello", "--n", "3", "--max-tokens", "4", "--temperature",
            "1.0", "--num-blocks", "64", "--no-chat"]
    assert main([*argv, "--json"]) == 0
    item = json.loads(capsys.readouterr().out)["completions"][0]
    assert [s["index"] for s in item["samples"]] == [0, 1, 2] and item["samples"][0]["completion"] == item["completion"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert all(f"sample {i} of 3" in out for i in (1, 2, 3))


def test_log_level_debug_says_what_the_scheduler_decides(tiny_llama, caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="pagedkv.sched")
    engine = Engine(EngineConfig(device="cpu", num_blocks=6, block_size=4, enable_prefix_caching=True),
                    model=tiny_llama)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    for _ in range(2):
        engine.add_request(list(range(1, 9)), params)
    _drain(engine)
    engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=2))
    _drain(engine)
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedkv.sched"]
    assert any("admit" in line for line in lines) and any("preempt" in line and "recompute" in line for line in lines)
    assert any("admit 2 (8 prompt tokens, 4 from the prefix cache" in line for line in lines), lines


def test_a_kernel_build_says_what_the_wait_is_for(capsys):
    import subprocess
    import sys

    from pagedkv.backends.cpu import build

    proc = subprocess.Popen([sys.executable, "-c", "print('ok')"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert build._wait_saying_so([proc])[0][0].strip() == "ok"
    assert "compiling the CPU attention kernel (once per machine)" in capsys.readouterr().err
