"""engine serve at shutdown and out of file descriptors, as a process (issue 25)."""

from __future__ import annotations

import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve_cli import free_port, long_stream, model_dir, start  # noqa: F401

# Long enough that shutdown (0.3 s after it starts, 0.5 s of grace) always cuts it: the fused cpu layers decode the
# 2-layer test model at >1000 tokens/s, so 450 tokens could finish first; this 4-layer model of 2048 positions
# has room for 1900 at a fraction of that speed.
LONG = {"prompt": "a", "max_tokens": 1900, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    from pagedkv.serve.testing import byte_level_tokenizer
    from pagedkv.testing import tiny_llama

    tokenizer = byte_level_tokenizer()
    path = tmp_path_factory.mktemp("tiny-long")
    tiny_llama(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
               max_position_embeddings=2048).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def running(url: str) -> bool:
    text = httpx.get(url + "/metrics", timeout=5).text
    return any(line.startswith("pagedkv:num_requests_running") and not line.endswith(" 0.0")
               for line in text.splitlines())


def test_a_non_streamed_request_cut_by_shutdown_answers_200_with_its_partial_text(long_model_dir):
    proc, url = start(long_model_dir, "--shutdown-timeout", "0.5", "--max-num-seqs", "1")
    answer: dict = {}

    def ask() -> None:
        answer["response"] = httpx.post(url + "/v1/completions", json=LONG, timeout=120)

    asker = threading.Thread(target=ask)
    asker.start()
    deadline = time.monotonic() + 60
    while not running(url):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    asker.join(60)
    _, err = proc.communicate(timeout=60)
    response = answer["response"]
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert 0 < response.json()["usage"]["completion_tokens"] < LONG["max_tokens"] and choice["text"]
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_a_second_signal_ends_everything_at_once_without_a_traceback(long_model_dir):
    # the long model and LONG's length: 450 tokens of the 2-layer model can end in the 0.5 s between the signals
    # (they did on a fast CPU), and a stream that finishes on its own is not cut by the second signal
    proc, url = start(long_model_dir, "--shutdown-timeout", "60")
    client, stream = long_stream(url, LONG["max_tokens"])
    lines = stream.iter_lines()
    next(line for line in lines if line.startswith("data: "))
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest = [line for line in lines if line]
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - started < 15  # not the 60 s grace period
    assert rest[-1] == "data: [DONE]" and any('"abort"' in line for line in rest)
    assert proc.returncode == 0 and "Traceback" not in err and "CancelledError" not in err, err
    client.close()


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


def test_out_of_file_descriptors_the_server_recovers_with_one_quiet_line(model_dir, tmp_path):  # noqa: F811
    port = free_port()
    engine = Path(sys.executable).with_name("engine")
    log = (tmp_path / "server.log").open("w+")
    proc = subprocess.Popen(
        [str(engine), "serve", "--model", str(model_dir), "--port", str(port), "--device", "cpu", "--num-blocks",
         "64", "--block-size", "8", "--log-level", "warning", "--header-timeout", "2", "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=log, preexec_fn=_low_fd_limit,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None
            assert time.monotonic() < deadline
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        hogs = []
        for _ in range(300):  # half-sent requests: more than the server has descriptors for
            sock = socket.socket()
            sock.setblocking(False)
            try:
                sock.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            hogs.append(sock)
        time.sleep(0.5)
        for sock in hogs:
            try:
                sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                pass
        time.sleep(3)  # the header deadline closes the first ones; the rest are accepted and closed in turn
        for sock in hogs:
            sock.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not recover"
            time.sleep(0.2)
        done = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
        assert done.status_code == 200, done.text
    finally:
        proc.terminate()
        proc.wait(60)
    log.seek(0)
    text = log.read()
    assert "Traceback" not in text, text[-3000:]
    assert "out of file descriptors" in text  # it did run out: the 300 sockets were more than it had
    assert len(text.splitlines()) <= 10, text[-3000:]
