"""lm-eval (EleutherAI's evaluation harness), unmodified, against a live ``engine serve`` on a tiny random checkpoint.

A multiple-choice task scored through ``local-completions`` (its loglikelihood request: token ids, ``echo`` with
``logprobs``, ``max_tokens: 1``) must give the same per-choice loglikelihoods as lm-eval's own ``hf`` model on the
same checkpoint; a generation task goes through ``local-chat-completions``. The tasks and their data are written
to the test's tmp dir: nothing comes from a hub. ``bypass`` and ``acc`` are computed locally by lm-eval.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import MODEL, running_server
from tiny_checkpoint import save_tiny

from pagedkv.core.config import EngineConfig
from pagedkv.core.engine import Engine

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[clients]', which make setup does)")

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "a city by the sea"], "answer": 0},
    {"question": "Two and two make", "choices": ["four", "five"], "answer": 0},
    {"question": "Q: Which one is red?\nA:", "choices": [" a tomato", " the sky", " grass", " snow"], "answer": 0},
]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1"}


def task_yaml(folder, name: str, output_type: str, extra: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {folder / 'datasets'}\ntest_split: test\noutput_type: {output_type}\n"
        f"doc_to_text: question\n{extra}")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    task_yaml(folder, "pagedkv_tiny_mc", "multiple_choice",
              "doc_to_choice: choices\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    task_yaml(folder, "pagedkv_tiny_gen", "generate_until",
              "doc_to_target: question\ngeneration_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 6\n"
              "  do_sample: false\nmetric_list:\n  - metric: bypass\n")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("lm_eval_tiny"))


@pytest.fixture(scope="module")
def served(checkpoint):
    engine = Engine(EngineConfig(model=str(checkpoint), device="cpu", num_blocks=256, block_size=8))
    with running_server(engine) as (url, _):
        yield url


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def evaluate(tasks, task: str, model: str, model_args: dict, **options) -> list[dict]:
    """lm-eval's Python entry point (what its CLI calls); the logged samples sorted by document."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=manager,
                                      log_samples=True, batch_size=1, bootstrap_iters=0, **options)
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def loglikelihoods(samples: list[dict]) -> list[list[float]]:
    """Each document's per-choice loglikelihood, as lm-eval logged them (``resps``: one ``[(ll, greedy)]`` each)."""
    return [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]


def test_local_completions_loglikelihoods_equal_lm_evals_hf_model(tasks, checkpoint, served):
    served_args = {"model": MODEL, "base_url": served + "/v1/completions", "tokenizer_backend": "huggingface",
                   "tokenizer": str(checkpoint), "num_concurrent": 1, "max_retries": 1}
    via_server = loglikelihoods(evaluate(tasks, "pagedkv_tiny_mc", "local-completions", served_args))
    via_hf = loglikelihoods(evaluate(tasks, "pagedkv_tiny_mc", "hf",
                                     {"pretrained": str(checkpoint), "dtype": "float32"}, device="cpu"))
    assert [len(choices) for choices in via_server] == [len(doc["choices"]) for doc in DOCS]
    assert [len(choices) for choices in via_hf] == [len(doc["choices"]) for doc in DOCS]
    worst = max(abs(a - b) for sa, sb in zip(via_server, via_hf) for a, b in zip(sa, sb))
    assert worst < 1e-4, (via_server, via_hf)
    assert all(value < 0 for choices in via_server for value in choices)


def test_local_chat_completions_generate_until(tasks, served):
    chat_args = {"model": MODEL, "base_url": served + "/v1/chat/completions", "num_concurrent": 1,
                 "max_retries": 1, "max_gen_toks": 6}
    samples = evaluate(tasks, "pagedkv_tiny_gen", "local-chat-completions", chat_args, apply_chat_template=True)
    assert len(samples) == len(DOCS)
    for doc, sample in zip(DOCS, samples):
        # the same request sent by hand answers the same greedy text lm-eval logged
        direct = httpx.post(served + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": doc["question"]}], "max_tokens": 6,
            "temperature": 0, "stop": ["\n\n"], "seed": 1234}).json()
        assert sample["resps"] == [[direct["choices"][0]["message"]["content"]]]
