"""engine run --input/--output: the OpenAI batch file format, one output line per input line."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy
from pagedkv.cli.batch_file import run_batch
from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine


@pytest.fixture(scope="module")
def chat_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def wide_llama(chat_tokenizer):
    """A tiny random Llama whose vocabulary fits the real tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(chat_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def _engine(model, tokenizer):
    return Engine(EngineConfig(num_blocks=64, block_size=8, device="cpu"), model=model, tokenizer=tokenizer)


def _line(custom_id, url, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_every_line_gets_its_own_result_and_bad_lines_do_not_stop_the_rest(wide_llama, chat_tokenizer):
    lines = [
        _line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}),
        "{not json",
        _line("bad-url", "/v1/embeddings", {"input": "x"}),
        _line("text", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4}),
        "",
        _line("unknown-field", "/v1/completions", {"prompt": "x", "best_of": 3}),
        _line("too-long", "/v1/completions", {"prompt": list(range(1, 600)), "max_tokens": 2}),
        _line("bad-temp", "/v1/completions", {"prompt": "x", "temperature": "hot"}),
        _line("ids-n2", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "n": 2, "seed": 1,
                                            "temperature": 0.9}),
    ]
    written = []
    ok, bad = run_batch(_engine(wide_llama, chat_tokenizer), lines, written.append, "tiny")
    assert (ok, bad) == (3, 5)
    by_id = {line["custom_id"]: line for line in written}
    assert len(written) == 8 and None in by_id  # the unparseable line is reported without a custom id
    for failed in ("bad-url", "unknown-field", "too-long", "bad-temp", None):
        line = by_id[failed]
        assert line["error"]["message"] and line["response"]["status_code"] == 400, line
    assert "best_of" in by_id["unknown-field"]["error"]["message"]
    assert "line 2" in by_id[None]["error"]["message"]

    chat = by_id["chat"]["response"]
    assert chat["status_code"] == 200 and by_id["chat"]["error"] is None
    body = chat["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    from pagedkv.core.llm import apply_chat_template

    prompt = apply_chat_template(chat_tokenizer, [{"role": "user", "content": "Hi"}])
    expected = hf_greedy(wide_llama, prompt, 5)
    full = chat_tokenizer.decode(expected, skip_special_tokens=True)
    assert body["choices"][0]["message"]["content"] == full.rstrip("\ufffd")  # a character cut at the end is dropped
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5, "total_tokens": len(prompt) + 5}
    assert body["choices"][0]["finish_reason"] == "length"

    text = by_id["text"]["response"]["body"]
    assert text["object"] == "text_completion"
    ids = chat_tokenizer("Once upon a time")["input_ids"]
    assert text["choices"][0]["text"] == chat_tokenizer.decode(hf_greedy(wide_llama, ids, 4),
                                                               skip_special_tokens=True).rstrip("\ufffd")
    two = by_id["ids-n2"]["response"]["body"]
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["usage"]["completion_tokens"] == 6


def test_results_are_written_as_they_finish_so_a_crash_keeps_them(wide_llama, chat_tokenizer):
    lines = [_line(f"r{i}", "/v1/completions", {"prompt": [3 + i], "max_tokens": 2 + 6 * i}) for i in range(3)]
    written = []

    def write(line):
        written.append(line)
        if len(written) == 2:
            raise KeyboardInterrupt  # the process dies after the second result

    with pytest.raises(KeyboardInterrupt):
        run_batch(_engine(wide_llama, chat_tokenizer), lines, write, "tiny")
    assert [line["custom_id"] for line in written] == ["r0", "r1"]  # shortest first: written before r2 ended


def test_chat_line_on_a_model_without_chat_template_is_an_error_line(wide_llama, chat_tokenizer):
    import copy

    plain = copy.deepcopy(chat_tokenizer)
    plain.chat_template = None
    written = []
    lines = [_line("c", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
             _line("p", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})]
    assert run_batch(_engine(wide_llama, plain), lines, written.append, "tiny") == (1, 1)
    assert "chat template" in written[0]["error"]["message"]


def _direct(model, tokenizer, prompt, **params):
    from pagedkv.core.sample.sampling_params import SamplingParams

    engine = _engine(model, tokenizer)
    engine.add_request(list(prompt), SamplingParams(**params))
    finished = []
    while engine.has_unfinished():
        finished += [out for out in engine.step(stream=False) if out.finished]
    return finished[0].outputs[0]


def test_sampling_fields_are_read_as_engine_serve_reads_them(wide_llama, chat_tokenizer):
    from pagedkv.core.llm import apply_chat_template

    forced = chat_tokenizer(" the", add_special_tokens=False)["input_ids"][0]
    # a +3 bias makes the random model repeat one token; the penalties must break that repetition
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3, "min_p": 0.05,
                 "logit_bias": {str(forced): 3.0}}
    hi = [{"role": "user", "content": "Hi"}]
    lines = [
        _line("lp", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 2, "ignore_eos": True}),
        _line("chat-lp", "/v1/chat/completions", {"messages": hi, "max_tokens": 4, "logprobs": True,
                                                  "top_logprobs": 3, "ignore_eos": True}),
        _line("bias", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "logit_bias": {str(forced): 100}}),
        _line("pen", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, **penalties}),
        _line("bad-bias", "/v1/completions", {"prompt": [5], "logit_bias": {"not-an-id": 1}}),
        _line("bad-bias-id", "/v1/completions", {"prompt": [5], "logit_bias": {str(len(chat_tokenizer) + 5): 1}}),
        _line("bad-pen", "/v1/completions", {"prompt": [5], "presence_penalty": 9}),
        _line("bad-top", "/v1/chat/completions", {"messages": hi, "top_logprobs": 2}),
    ]
    written = []
    assert run_batch(_engine(wide_llama, chat_tokenizer), lines, written.append, "tiny") == (4, 4)
    by_id = {line["custom_id"]: line for line in written}
    for failed, field in (("bad-bias", "logit_bias"), ("bad-bias-id", "logit_bias"), ("bad-pen", "presence_penalty"),
                          ("bad-top", "top_logprobs")):
        assert field in by_id[failed]["error"]["message"], by_id[failed]

    lp = by_id["lp"]["response"]["body"]["choices"][0]["logprobs"]
    direct = _direct(wide_llama, chat_tokenizer, [5, 6, 7], max_tokens=4, ignore_eos=True, logprobs=2)
    assert lp["token_logprobs"] == pytest.approx([e[t] for t, e in zip(direct.token_ids, direct.logprobs)], abs=1e-5)
    assert lp["tokens"] == [chat_tokenizer.decode([t]) for t in direct.token_ids]
    assert all(len(top) <= 2 and list(top.values()) == sorted(top.values(), reverse=True) for top in lp["top_logprobs"])

    content = by_id["chat-lp"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    prompt = apply_chat_template(chat_tokenizer, hi)
    direct = _direct(wide_llama, chat_tokenizer, prompt, max_tokens=4, ignore_eos=True, logprobs=3)
    assert [item["logprob"] for item in content] == pytest.approx(
        [e[t] for t, e in zip(direct.token_ids, direct.logprobs)], abs=1e-5)
    assert all(len(item["top_logprobs"]) == 3 for item in content)

    assert by_id["bias"]["response"]["body"]["choices"][0]["text"] == " the" * 3
    direct_params = {**penalties, "logit_bias": {forced: 3.0}}
    pen = _direct(wide_llama, chat_tokenizer, [5, 6, 7], max_tokens=8, ignore_eos=True, **direct_params)
    assert by_id["pen"]["response"]["body"]["choices"][0]["text"] == pen.text
    biased = _direct(wide_llama, chat_tokenizer, [5, 6, 7], max_tokens=8, ignore_eos=True, logit_bias={forced: 3.0})
    assert biased.token_ids == [forced] * 8
    assert 1 <= pen.token_ids.count(forced) < 8


def test_the_batch_runner_reads_serves_fields_without_importing_the_server_stack():
    import subprocess
    import sys

    # the request models (pydantic, a core dependency) are shared; the HTTP server's stack is not
    code = ("import sys, pagedkv.cli.batch_file; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
