"""Every user error at the `engine` command line is one `engine: error:` line and exit 2; Ctrl-C keeps what finished.

The CLI runs in a subprocess, as a user runs it, on a tiny random Llama saved
with a tiny word-level tokenizer (with or without a chat template).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_command import ENGINE, QUIET, assert_one_line_error, engine  # noqa: F401 - shared
from repo_paths import ROOT

VOCAB = 211
CHAT_TEMPLATE = (
    "{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
)


def _save_tiny_model(path: Path, chat_template: str | None) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedkv.testing import tiny_llama

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, VOCAB)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if chat_template:
        tokenizer.chat_template = chat_template
    tiny_llama().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return _save_tiny_model(tmp_path_factory.mktemp("base"), None)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return _save_tiny_model(tmp_path_factory.mktemp("chat"), CHAT_TEMPLATE)


RUN = ("run", "--device", "cpu", "--num-blocks", "64", "--block-size", "4", "--threads", "1")


# --- base models and --chat ---------------------------------------------------------------------------------------


def test_a_model_without_a_chat_template_runs_on_the_raw_prompt(base_model):
    proc = engine(*RUN, "--model", str(base_model), "--prompt", "w1 w2 w3", "--max-tokens", "3", "--ignore-eos",
                  "--json")
    assert proc.returncode == 0, proc.stderr.decode()
    out = json.loads(proc.stdout)
    assert out["summary"]["prompt_tokens"] == 3  # exactly the three words: no template around them
    assert out["summary"]["generated_tokens"] == 3
    assert out["completions"][0]["prompt"] == "w1 w2 w3"


def test_chat_on_a_model_without_a_template_is_one_line(base_model):
    proc = engine(*RUN, "--model", str(base_model), "--prompt", "w1", "--chat")
    assert_one_line_error(proc, "--chat", "no chat template", "--no-chat")


def test_a_chat_model_uses_its_template_unless_told_not_to(chat_model):
    base = (*RUN, "--model", str(chat_model), "--prompt", "w1 w2 w3", "--max-tokens", "2", "--ignore-eos", "--json")
    with_template = engine(*base)
    raw = engine(*base, "--no-chat")
    assert with_template.returncode == 0 and raw.returncode == 0, (with_template.stderr, raw.stderr)
    assert json.loads(with_template.stdout)["summary"]["prompt_tokens"] == 6  # w7 w1 w2 w3 w8 w9
    assert json.loads(raw.stdout)["summary"]["prompt_tokens"] == 3


# --- one line, exit 2, before anything slow -----------------------------------------------------------------------


def test_cupy_without_cuda_is_refused_before_the_model_loads(tmp_path):
    proc = engine(*RUN, "--backend", "cupy", "--model", str(tmp_path / "no-such-model"))
    assert_one_line_error(proc, "cupy")  # about the backend, not the (missing) model: decided first


@pytest.mark.parametrize("case", ["directory", "missing folder", "unwritable"])
def test_a_bad_trace_path_is_one_line_before_the_model_loads(tmp_path, case):
    if case == "directory":
        path = tmp_path
    elif case == "missing folder":
        path = tmp_path / "nope" / "run.ndjson"
    else:
        if os.geteuid() == 0:
            pytest.skip("root can write anywhere")
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        path = locked / "run.ndjson"
    proc = engine(*RUN, "--trace", str(path), "--model", str(tmp_path / "no-such-model"))
    assert_one_line_error(proc, "--trace")


def test_a_prompt_that_is_not_utf8_is_one_line(base_model):
    proc = engine(*RUN, "--model", str(base_model), b"--prompt", b"w1 \xff\xfe w2")
    assert_one_line_error(proc, "--prompt #1", "UTF-8", "0xff")


@pytest.mark.parametrize("size", ["infGiB", "-infGiB", "nanMiB", "1000000TiB", "100000000GiB"])
def test_an_impossible_kv_cache_memory_is_one_line(tmp_path, size):
    proc = engine(*RUN[:3], f"--kv-cache-memory={size}", "--model", str(tmp_path / "no-such-model"))
    assert_one_line_error(proc)


def test_more_kv_blocks_than_the_machine_has_is_one_line(base_model):
    proc = engine("run", "--device", "cpu", "--model", str(base_model), "--num-blocks", "16000000",
                  "--block-size", "256")  # 16M blocks x 256 tokens x 2 layers x 2 x 32 x 4 B: ~2 PiB
    assert_one_line_error(proc, "host memory", "available")


def test_a_billion_samples_is_one_line_naming_the_limit(tmp_path):
    proc = engine(*RUN, "--n", "1000000000", "--model", str(tmp_path / "no-such-model"))
    assert_one_line_error(proc, "--n", "PAGEDKV_MAX_SAMPLES")


def test_a_billion_simulated_requests_is_one_line_naming_the_limit():
    started = time.monotonic()
    proc = engine("simulate", "--num-requests", "1000000000")
    assert_one_line_error(proc, "--num-requests", "PAGEDKV_MAX_REQUESTS")
    assert time.monotonic() - started < 120


def test_a_raised_limit_is_honoured():
    proc = engine("simulate", "--num-requests", "5", "--num-blocks", "64", "--no-static", "--json",
                  env={"PAGEDKV_MAX_REQUESTS": "5"})
    assert proc.returncode == 0, proc.stderr.decode()
    over = engine("simulate", "--num-requests", "6", env={"PAGEDKV_MAX_REQUESTS": "5"})
    assert_one_line_error(over, "PAGEDKV_MAX_REQUESTS")


@pytest.mark.parametrize("budget", [("--num-blocks", "1000000000"), ("--kv-cache-memory", "1000TiB"),
                                    ("--swap-space", "1000TiB")])
def test_a_huge_simulated_pool_is_one_line(budget):
    proc = engine("simulate", *budget, "--num-requests", "3")
    assert_one_line_error(proc, "PAGEDKV_MAX_BLOCKS")


def test_deeply_nested_json_in_a_workload_is_one_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 200_000 + "]" * 200_000 + "\n")
    assert_one_line_error(engine("simulate", "--workload", str(path)), "nested too deeply")


def test_deeply_nested_json_in_a_trace_is_one_line(tmp_path):
    hello = {"v": 2, "seq": 0, "type": "hello", "t": 0, "num_blocks": 8, "block_size": 4}
    path = tmp_path / "deep.ndjson"
    path.write_text(json.dumps(hello) + "\n" + "{\"a\":" * 200_000 + "1" + "}" * 200_000 + "\n")
    assert_one_line_error(engine("simulate", "--workload", str(path)), "line 2", "nested too deeply")


def test_a_trace_claiming_a_billion_blocks_is_one_line(tmp_path):
    hello = {"v": 2, "seq": 0, "type": "hello", "t": 0, "num_blocks": 10**9, "block_size": 4}
    path = tmp_path / "huge.ndjson"
    path.write_text(json.dumps(hello) + "\n")
    assert_one_line_error(engine("simulate", "--workload", str(path)), "num_blocks", "PAGEDKV_MAX_BLOCKS")


# --- interrupts -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_keeps_what_finished_and_ends_the_trace(base_model, tmp_path, sig):
    trace = tmp_path / "run.ndjson"
    prompts = [arg for i in range(1, 9) for arg in ("--prompt", f"w{i} w{i + 1}")]
    cmd = [*ENGINE, "run", "--device", "cpu", "--model", str(base_model),
           "--num-blocks", "256", "--block-size", "4", "--threads", "1", "--max-num-seqs", "1",
           "--max-tokens", "400", "--ignore-eos", "--trace", str(trace), "--json", *prompts]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, **QUIET})
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:  # wait until the run loop is stepping
            if trace.exists() and trace.read_bytes().count(b"\n") >= 20:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, err.decode()
    assert b"Traceback" not in err, err.decode()
    report = json.loads(out)
    summary = report["summary"]
    assert summary["stopped_by"] == signal.Signals(sig).name
    assert summary["unfinished_requests"] >= 1
    assert len(report["completions"]) == 8 - summary["unfinished_requests"]
    last = json.loads(trace.read_bytes().splitlines()[-1])
    assert last["type"] == "end"


# A signal after the command's work is done (a stray SIGTERM landed between `engine simulate`'s one-line error and
# its exit in a CI run, and printed a `Terminated` traceback): the entry point's own exit path, with main replaced.
_LATE_SIGNAL = """
import atexit, os, signal, sys, time
import pagedkv.cli.main as cli
from pagedkv.cli.interrupts import raise_on_sigterm

def closing_handler():
    os.kill(os.getpid(), signal.{sig})
    time.sleep(0.2)  # the signal is delivered while this handler still runs
    print("handler finished", file=sys.stderr)

def main():
    raise_on_sigterm()
    atexit.register(closing_handler)
    {body}

cli.main = main
cli.entry()
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_exit_handlers_changes_the_status_not_the_output(sig):
    body = 'print("engine: error: no such thing", file=sys.stderr); return 2'
    proc = subprocess.run([sys.executable, "-c", _LATE_SIGNAL.format(sig=sig, body=body)], capture_output=True,
                          timeout=120, cwd=ROOT)
    err = proc.stderr.decode()
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert err.splitlines() == ["engine: error: no such thing", "handler finished"], err
    assert proc.returncode == 128 + getattr(signal, sig)


def test_a_signal_inside_mains_error_report_is_one_more_line():
    body = ('print("engine: error: no such thing", file=sys.stderr); os.kill(os.getpid(), signal.SIGTERM); '
            'time.sleep(5); return 2')
    proc = subprocess.run([sys.executable, "-c", _LATE_SIGNAL.format(sig="SIGTERM", body=body)], capture_output=True,
                          timeout=120, cwd=ROOT)
    err = proc.stderr.decode()
    assert "Traceback" not in err, err
    assert err.splitlines()[:2] == ["engine: error: no such thing", "engine: terminated (SIGTERM)"], err
    assert proc.returncode == 128 + signal.SIGTERM
